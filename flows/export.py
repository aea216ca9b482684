"""`forgeflow export <uri|run> <dir>`: a trained policy as a plain HF folder, from any store.

    forgeflow export last ./my-model                          # the last run's final policy (flows.last_run)
    forgeflow export <flow run id> ./my-model                 # a recorded run's final policy
    forgeflow export s3://bucket/runs/grpo/<key>/policy ./my-model   # any committed policy or sft/grpo artifact
    forgeflow export last ./my-model --push-to-hub me/my-model       # then upload it (needs a Hugging Face token)

The copy is verified against the policy's manifest. A run is read from the store it recorded.
"""


from __future__ import annotations

from pathlib import Path

from flows.last_run import read_run, run_store
from forge_core.artifacts.policy import export_policy_folder
from forge_core.config import RunConfig
from forge_core.storage import ObjectStore


def is_uri(source: str) -> bool:
    """A store URI or a local path, as opposed to a run (`last` or a flow run id)."""
    return "://" in source or source.startswith(("/", ".", "~"))


def policy_source(source: str, cfg: RunConfig) -> tuple[ObjectStore, str]:
    """The store and URI that `source` (a URI, `last` or a flow run id) names."""
    if is_uri(source):
        store = ObjectStore(
            source,
            endpoint_url=cfg.storage.endpoint_url,
            region=cfg.storage.region,
            retries=cfg.storage.retries,
            retry_backoff_s=cfg.storage.retry_backoff_s,
            retry_horizon_s=cfg.storage.retry_horizon_s,
        )
        return store, store.root  # normalized: a local path becomes its absolute file:// URI
    record = read_run(cfg.logging.dir, source)
    return run_store(record, cfg), record["final_policy_uri"]


def hub_token() -> str:
    """The Hugging Face token huggingface_hub would use; ValueError when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ValueError(
            "--push-to-hub: no Hugging Face token; set HF_TOKEN to a token with write access (or run "
            "`hf auth login`), or export without --push-to-hub; nothing was exported"
        )
    return token


def push_to_hub(folder: Path, repo_id: str, token: str) -> str:
    """Upload `folder` to the model repo `repo_id` (created private when missing); returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=True, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")
    return f"https://huggingface.co/{repo_id}"


def export(source: str, target: str, cfg: RunConfig, hub_repo: str | None = None) -> Path:
    """Copy the policy `source` names into `target` (and upload it to `hub_repo`; without a Hugging Face
    token, ValueError before anything is copied); prints what it did."""
    token = hub_token() if hub_repo else None  # refused before anything is copied
    store, uri = policy_source(source, cfg)
    folder = Path(target).expanduser().absolute()
    copied = export_policy_folder(store, uri, folder)
    print(f"exported {copied}\n      to {folder} (verified; load it with transformers.AutoModelForCausalLM)")
    if hub_repo:
        print(f"pushed to {push_to_hub(folder, hub_repo, token)}")
    return folder


def export_command(final_policy_uri: str, cfg: RunConfig, target: str | None = None) -> str:
    """The shell command that exports a run's final policy, the store's endpoint included."""

    endpoint = f"FORGE_S3_ENDPOINT_URL={cfg.storage.endpoint_url} " if cfg.storage.endpoint_url else ""
    return f"{endpoint}forgeflow export {final_policy_uri} {target or './' + cfg.name + '-policy'}"

