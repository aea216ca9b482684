"""Credentials embedded in URLs are used where a URL is opened and recorded nowhere.

A real HTTP server serves the data source only to a request with the right basic-auth password, presigned
signature and token; a real Prefect flow prepares data from it through a real worker process. Afterwards
every byte the run left (store objects, Parquet contents, specs, manifests, logs, the launch registry, the
flow's parameters, every Prefect log, artifact and state message) is searched for every secret. S3 endpoint
URLs cannot carry credentials at all (botocore does not use them): such a config is refused with a message
that shows the URL redacted.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow.parquet as pq
import pytest
from fault_kit import TINY_CONFIG, all_artifacts_text, all_logs, flow_run, task_runs
from prefect import flow

from forge_core.config import ConfigError, config_to_dict, config_to_json, load_config
from forge_core.credentials import (
    SECRET_URLS_ENV,
    hide_credentials,
    hide_credentials_in_overrides,
    redact_url,
    reveal_url,
    scrub_text,
)
from tasks import run_as_task

SECRETS = {
    "password": f"pw-{uuid.uuid4().hex}",
    "signature": f"sig-{uuid.uuid4().hex}",
    "token": f"tok-{uuid.uuid4().hex}",
}
ROWS = "".join(f'{{"prompt": "{i}+1=", "completion": "{i + 1}"}}\n' for i in range(40)) + "not json\n"


class _TokenServer(ThreadingHTTPServer):
    """Serves ROWS at /train.jsonl (HEAD, GET, byte ranges) to requests that carry every secret; 403 else."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.authorized = 0
        self.refused = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/train.jsonl"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _allowed(self) -> bool:
        query = parse_qs(urlsplit(self.path).query)
        basic = base64.b64encode(f"reader:{SECRETS['password']}".encode()).decode()
        ok = (
            self.headers.get("Authorization") == f"Basic {basic}"
            and query.get("X-Amz-Signature") == [SECRETS["signature"]]
            and query.get("token") == [SECRETS["token"]]
            and urlsplit(self.path).path in ("/train.jsonl", "/broken.jsonl")
        )
        if ok:
            self.server.authorized += 1
        else:
            self.server.refused += 1
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()
        return ok

    def do_HEAD(self) -> None:
        if self._allowed():
            self._headers(200, len(ROWS.encode()))

    def do_GET(self) -> None:
        if not self._allowed():
            return
        if urlsplit(self.path).path == "/broken.jsonl" and self.headers.get("Range"):  # fails mid-read
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = ROWS.encode()
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start, _, end = wanted.removeprefix("bytes=").partition("-")
            first, last = int(start), min(int(end) if end else len(body) - 1, len(body) - 1)
            self._headers(206, last - first + 1, f"bytes {first}-{last}/{len(body)}")
            self.wfile.write(body[first : last + 1])
            return
        self._headers(200, len(body))
        self.wfile.write(body)

    def _headers(self, status: int, length: int, content_range: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()


@pytest.fixture(scope="module")
def token_server():
    server = _TokenServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _source_url(server: _TokenServer) -> str:
    netloc = f"reader:{SECRETS['password']}@127.0.0.1:{server.server_address[1]}"
    return f"http://{netloc}/train.jsonl?X-Amz-Signature={SECRETS['signature']}&X-Amz-Expires=600&token={SECRETS['token']}"


@flow(name="security-prepare-from-a-tokenised-url")
def prepare_from(config: str, overrides: list[str]) -> str:
    cfg = load_config(config, overrides)
    return run_as_task(cfg, "prepare", {})


@pytest.fixture(scope="module")
def tokenised_run(prefect_api, token_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenised-source")
    overrides = [
        f"storage.root=file://{root}/store",
        f"logging.dir={root}/runs",
        f"data.source={_source_url(token_server)}",
        "data.format=jsonl",
        "data.tokenizer.vocab_size=300",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_LAUNCH_REGISTRY", str(root / "launches"))
        # What the CLI entry points do before calling a flow: Prefect records the flow's parameters.
        state = prepare_from(TINY_CONFIG, hide_credentials_in_overrides(overrides), return_state=True)
    return root, state


def _leaks(text: str) -> list[str]:
    return sorted(name for name, secret in SECRETS.items() if secret in text)


def _everything_under(root: Path) -> dict[str, str]:
    """Every file's bytes (as text) and, for Parquet, its decoded rows: compressed pages hide strings."""
    found = {}
    for path in (p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found[str(path)] = data.decode("utf-8", errors="replace")
        if path.suffix == ".parquet":
            found[f"{path} (rows)"] = json.dumps(pq.read_table(path).to_pylist(), default=str)
    return found


@pytest.mark.integration
def test_a_tokenised_source_is_read_and_its_secrets_are_recorded_nowhere(tokenised_run, token_server):
    root, state = tokenised_run
    assert state.is_completed(), state.message
    assert token_server.authorized > 0 and token_server.refused == 0  # the secrets were really used

    outputs = _everything_under(root)
    redacted = "http://***@127.0.0.1"
    # What is searched holds the source, redacted: the spec and manifest configs, the rejects table.
    assert any(name.endswith(".json") and "_spec" in name and redacted in text for name, text in outputs.items())
    assert any("rejects.parquet (rows)" in name and "X-Amz-Signature=***" in text for name, text in outputs.items())
    flow_run_id = state.state_details.flow_run_id
    parameters = json.dumps(flow_run(flow_run_id).parameters)
    assert "X-Amz-Signature=***" in parameters and "token=***" in parameters
    runs = task_runs(flow_run_id)
    prefect_text = "\n".join([
        parameters,
        "\n".join(all_logs()),
        all_artifacts_text(),
        str(state.message),
        *(str(run.state.message) for run in runs.values() if run.state),
    ])

    leaked = {name: _leaks(text) for name, text in outputs.items() if _leaks(text)}
    if _leaks(prefect_text):
        leaked["Prefect parameters, logs, artifacts and state messages"] = _leaks(prefect_text)
    assert leaked == {}


@pytest.mark.integration
def test_the_wandb_config_of_a_run_with_a_tokenised_source_holds_it_redacted(token_server, tmp_path):
    from forge_core.metrics import build_sinks

    overrides = [f"data.source={_source_url(token_server)}", "data.tokenizer.vocab_size=300", f"logging.dir={tmp_path}"]
    cfg = load_config(TINY_CONFIG, [*overrides, "logging.wandb_mode=offline"])
    sink = build_sinks(cfg.logging, "tiny-sft", config=config_to_dict(cfg))
    sink.log({"loss": 1.0}, step=1)
    sink.close()

    outputs = _everything_under(tmp_path)
    assert any("wandb" in name and "token=***" in text for name, text in outputs.items())
    assert {name: _leaks(text) for name, text in outputs.items() if _leaks(text)} == {}


def test_s3_endpoints_and_roots_with_credentials_are_refused_showing_them_redacted():
    secret = SECRETS["password"]
    with pytest.raises(ConfigError) as refused:
        load_config(
            TINY_CONFIG,
            [
                f"storage.endpoint_url=http://minio:{secret}@127.0.0.1:9000",
                f"storage.root=s3://key:{secret}@bucket/run",
                f"model.hf_path=https://u:{secret}@host/model",
            ],
        )
    message = str(refused.value)
    assert "storage.endpoint_url='http://***@127.0.0.1:9000': holds credentials" in message
    assert "AWS_ACCESS_KEY_ID" in message  # the fix
    assert "storage.root=" in message and "model.hf_path=" in message
    assert secret not in message


def test_a_tokenised_source_stays_redacted_in_the_config_and_is_revealed_only_to_its_reader(token_server):
    real = _source_url(token_server)
    cfg = load_config(TINY_CONFIG, [f"data.source={real}", "data.tokenizer.vocab_size=300"])

    assert cfg.data.source == redact_url(real)
    assert _leaks(config_to_json(cfg)) == []
    assert reveal_url(cfg.data.source) == real
    assert scrub_text(f"GET {real} failed") == f"GET {cfg.data.source} failed"


def test_a_failing_read_names_the_source_redacted_and_stays_retryable(token_server):
    import pyarrow as pa

    from forge_core.data.sources import read_source

    broken = hide_credentials(_source_url(token_server).replace("/train.jsonl", "/broken.jsonl"))

    with pytest.raises(OSError) as failed:  # an HTTP 500 is the transport's: retryable
        list(read_source(broken, "jsonl", {"prompt": pa.string()}, 8))

    assert "500" in str(failed.value) and "127.0.0.1" in str(failed.value)
    assert _leaks(str(failed.value)) == [] and failed.value.__cause__ is None


def test_a_worker_not_given_the_credentials_says_how_to_pass_them(monkeypatch):
    monkeypatch.delenv(SECRET_URLS_ENV, raising=False)
    never_seen = "https://***@data.example/x.jsonl?token=***"

    with pytest.raises(ValueError, match=rf"data.source=.*redacted.*{SECRET_URLS_ENV}"):
        reveal_url(never_seen, what="data.source")
    real = "https://u:p@data.example/x.jsonl?token=t"
    monkeypatch.setenv(SECRET_URLS_ENV, json.dumps({never_seen: real}))
    assert reveal_url(never_seen) == real


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("http://user:secret@host:9000/p", "http://***@host:9000/p"),
        ("https://token@host/p", "https://***@host/p"),
        (
            "https://b.s3.amazonaws.com/k.jsonl?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ab",
            "https://b.s3.amazonaws.com/k.jsonl?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&X-Amz-Signature=***",
        ),
        ("https://h/p?sig=1&sv=2&api_key=3&access_token=4", "https://h/p?sig=***&sv=2&api_key=***&access_token=***"),
        ("s3://bucket/data/train.jsonl?versionId=3", "s3://bucket/data/train.jsonl?versionId=3"),
        ("/local/path/with@sign?and=query", "/local/path/with@sign?and=query"),
        ("demo", "demo"),
    ],
)
def test_redact_url(url, redacted):
    assert redact_url(url) == redacted
    assert hide_credentials(url) == redacted
    assert redact_url(redacted) == redacted  # idempotent
