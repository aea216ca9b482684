"""Weights from a trainer to a running vLLM engine over a transfer group (forge_core.rollout.weight_transfer, the
gloo backend of vLLM's weight-transfer API, driven as forge_core.run.weight_sync drives it from a trainer rank).

The trainer is a real torchtitan engine started from the world's policy with its weights moved; the receiving
engine is a real in-process vLLM engine. After a transfer, every parameter of vLLM's model equals, bitwise, what
the same engine holds after reloading the folder the trainer's export writes: the transfer delivers the
exported policy, not an approximation of it; over the group's broadcasts and through shared memory alike.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.tensor import DTensor

from forge_core.config import load_config
from forge_core.rollout.weight_buckets import (
    Param,
    SharedMemoryBuckets,
    bucket_folder,
    decoder_layer,
    plan_buckets,
)
from forge_core.rollout.weight_transfer import GeneratorClient, GlooTrainerEngine, GlooTrainerInit
from forge_core.run.weight_sync import HeldPolicySource
from tests.rollout.conftest import ENGINE_POLICY_VERSION, MODEL_CFG


def test_buckets_cover_every_parameter_in_order_within_the_bound():
    sizes = [(4,), (8, 8), (2,), (100,), (3,)]  # 16, 256, 8, 400, 12 bytes in float32
    params = [Param(f"p{k}", torch.float32, shape) for k, shape in enumerate(sizes)]
    assert [list(b) for b in plan_buckets(params, bucket_bytes=300)] == [[0, 1, 2], [3], [4]]
    assert [list(b) for b in plan_buckets(params, bucket_bytes=1000)] == [[0, 1, 2, 3, 4]]
    assert [list(b) for b in plan_buckets(params, bucket_bytes=1)] == [[0], [1], [2], [3], [4]]  # one each
    assert plan_buckets([], bucket_bytes=1) == []


def test_shared_memory_buckets_never_split_a_decoder_layer():
    names = ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.k.weight",
             "model.layers.1.q.weight", "model.layers.1.k.weight", "model.layers.10.q.weight", "model.norm.weight"]  # fmt: skip
    params = [Param(name, torch.float32, (4,)) for name in names]  # 16 bytes each
    assert [decoder_layer(n) for n in names[:4]] == ["model.embed_tokens.weight", "model.layers.0", "model.layers.0",
                                                     "model.layers.1"]  # fmt: skip
    # 40 bytes: a layer's 32 bytes never share a bucket with a neighbour's, and are never cut.
    assert [list(b) for b in plan_buckets(params, 40, together=decoder_layer)] == [[0], [1, 2], [3, 4], [5, 6]]
    # 8 bytes, less than one parameter: each layer is still one bucket.
    assert [list(b) for b in plan_buckets(params, 8, together=decoder_layer)] == [[0], [1, 2], [3, 4], [5], [6]]


_SEND_WITHOUT_ENGINES = textwrap.dedent("""
    import glob, os, socket, sys
    import torch
    import forge_core.run.trainer_group  # the trainer rank's actor, its push path included
    from forge_core.rollout.weight_buckets import BucketSender, EngineRendezvous, Param

    class Weights:
        def __init__(self):
            self.tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(5)}
        def metadata(self):
            return [Param(n, torch.bfloat16, tuple(t.shape)) for n, t in self.tensors.items()]
        def __iter__(self):
            return iter(self.tensors.items())

    class NoEngines:  # a group of the sender alone: every broadcast and barrier completes
        def __init__(self):
            self.steps = []
        def __getattr__(self, step):
            return lambda *args: self.steps.append(step)

    for shared_memory in (False, True):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        client = NoEngines()
        sender = BucketSender.join(Weights(), client, EngineRendezvous("127.0.0.1", port, 1, 1, 16), shared_memory)
        sender.send_weights()
        sender.shutdown()
        assert client.steps == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                "finish_weight_update"], client.steps
    assert not glob.glob(f"/dev/shm/forgeflow-weights-{os.getpid()}-*")  # the shared-memory files are gone
    print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
""")


def test_a_trainer_rank_sends_weights_without_importing_vllm():
    """Importing vLLM takes seconds on a CPU, and a trainer rank that needed it for a push would make the
    engines wait: the rank's module and a whole send, over the group and through shared memory, import none."""
    done = subprocess.run(
        [sys.executable, "-c", _SEND_WITHOUT_ENGINES], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


_SENDER_ENDED_MID_ROUND = textwrap.dedent("""
    import glob, os, signal, socket, sys, threading, time
    import torch
    from forge_core.rollout import weight_buckets

    class Weights:
        def __init__(self):
            self.tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(5)}
        def metadata(self):
            return [weight_buckets.Param(n, torch.float32, tuple(t.shape)) for n, t in self.tensors.items()]
        def __iter__(self):
            return iter(self.tensors.items())

    class StalledEngine:  # joins the group, then never loads a bucket: the sender waits at barrier 0
        def init_weight_transfer_engine(self, info):
            self.group = weight_buckets.open_group(
                info["master_address"], info["master_port"], 1, info["world_size"], "127.0.0.1", info["timeout_s"]
            )
        def start_weight_update(self):
            pass
        def update_weights(self, info):
            threading.Event().wait()
        def finish_weight_update(self, weight_version=None):
            pass

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rendezvous = weight_buckets.EngineRendezvous("127.0.0.1", port, 1, 2, 16, timeout_s=600)
    sender = weight_buckets.BucketSender.join(Weights(), StalledEngine(), rendezvous, shared_memory=True)
    threading.Thread(target=sender.send_weights, daemon=True).start()
    mine = os.path.join(weight_buckets.bucket_folder(), f"forgeflow-weights-{os.getpid()}-*")
    while len(glob.glob(mine)) < 2:  # bounded by the test's timeout
        time.sleep(0.05)
    if sys.argv[1] == "release":  # what ending a trainer group asks of each rank before it kills it
        print(len(weight_buckets.release_shared_memory()), len(glob.glob(mine)), flush=True)
    else:
        print(0, len(glob.glob(mine)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["release", "kill"], ids=["released-then-killed", "killed"])
def test_a_sender_ended_in_the_middle_of_a_round_leaves_no_shared_memory(how):
    """A trainer rank is ended with its group while it waits for an engine that never reached the round's first
    barrier, so no engine has mapped its files and it has not removed them. Asked first (`release`, as ending a
    group does), it removes them itself; killed outright, the host's next sender removes the dead one's files."""
    sender = subprocess.Popen([sys.executable, "-c", _SENDER_ENDED_MID_ROUND, how], stdout=subprocess.PIPE, text=True)
    out, _ = sender.communicate(timeout=300)
    assert sender.returncode == -signal.SIGKILL, out
    removed, left = (int(n) for n in out.split())
    files = os.path.join(bucket_folder(), f"forgeflow-weights-{sender.pid}-*")
    if how == "kill":
        assert left == 2 and len(glob.glob(files)) == 2  # a killed sender cannot remove them itself
        SharedMemoryBuckets.create(16).close()  # the host's next sender
    else:
        assert (removed, left) == (2, 0), out
    assert not glob.glob(files)


def _vllm_state(generator) -> dict[str, torch.Tensor]:
    def read(worker):
        return {k: v.detach().clone() for k, v in worker.model_runner.model.state_dict().items()}

    return generator._llm.collective_rpc(read)[0]


class _FileWatchingSource(HeldPolicySource):
    """The trainer's weights; records, as each parameter is packed, whether files match `pattern` and how many
    threads the packing thread's torch operations use."""

    def __init__(self, engine, pattern: str, gathered=None) -> None:
        super().__init__(engine, gathered)
        self.pattern = pattern
        self.files_seen: list[bool] = []
        self.threads_seen: set[int] = set()

    def __iter__(self):
        for item in super().__iter__():
            self.files_seen.append(bool(glob.glob(self.pattern)))
            self.threads_seen.add(torch.get_num_threads())
            yield item


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("shared_memory", "from_export"), [(False, False), (True, False), (False, True)],
    ids=["over-the-group", "shared-memory", "from-the-export"],
)
def test_a_transfer_delivers_the_exported_policy_bitwise(world, generator, tmp_path, shared_memory, from_export):
    """from_export: the source iterates the full weights the export gathered (a push alongside the export) instead
    of gathering the live ones."""
    from forge_core.engine import Engine
    from forge_core.models import write_hf_folder

    cfg = load_config(None, ["training.device=cpu", f"model.flavor={MODEL_CFG.flavor}",
                             f"model.max_seq_len={MODEL_CFG.max_seq_len}", "data.max_seq_len=64"])  # fmt: skip
    trainer = Engine.Config.from_run_config(
        cfg, world.vocab_size, cfg.grpo.optimizer, total_steps=1, init_weights_dir=str(world.policy_dir)
    ).build()
    with torch.no_grad():  # weights the engine has never seen
        for param in trainer.model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param  # one rank: the whole parameter
            local.add_(torch.randn(local.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    before = _vllm_state(generator)

    version = "transferred"
    # Buckets far smaller than the model: several broadcasts, parameters split across them.
    init = GlooTrainerInit(
        "127.0.0.1", _free_port(), world_size=2, bucket_bytes=64 * 1024, timeout_s=60, shared_memory=shared_memory,
        rank=0,
    )  # fmt: skip
    gathered = trainer.full_state_dict(dtype=trainer.export_dtype) if from_export else None
    source = _FileWatchingSource(trainer, f"/dev/shm/forgeflow-weights-{os.getpid()}-*", gathered)
    sender = GlooTrainerEngine.trainer_init(init, client=GeneratorClient(generator, version), source=source)
    assert len(plan_buckets(HeldPolicySource(trainer).metadata(), init.bucket_bytes)) > 3
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a team the packing must not use through shared memory, even on a 1-core machine
    try:
        sender.send_weights()
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(threads)
    sender.shutdown()
    # Through shared memory the engine loads on the sender's cores: the sender packs on one thread.
    assert source.threads_seen == ({1} if shared_memory else {2}), source.threads_seen
    transferred = _vllm_state(generator)
    assert generator.policy_version == version
    # The shared-memory files exist while the first bucket is packed and are gone (every member has mapped them)
    # before the last one is: a process killed mid-transfer leaves nothing behind.
    assert source.files_seen[0] == shared_memory and not source.files_seen[-1], source.files_seen
    assert not glob.glob(source.pattern)

    exported = write_hf_folder(
        trainer.full_state_dict(dtype=trainer.export_dtype), cfg.model, world.vocab_size, tmp_path / "export",
        world.tokenizer_dir,
    )  # fmt: skip
    generator.reload(exported, "exported")
    reloaded = _vllm_state(generator)
    assert set(transferred) == set(reloaded)
    assert any(not torch.equal(before[k], transferred[k]) for k in before), "the transfer changed nothing"
    differ = [k for k in reloaded if not torch.equal(transferred[k], reloaded[k])]
    assert differ == [], f"after the transfer, {differ} differ from the exported policy's weights"

    # Leave the module's engine as the other tests found it.
    restored = tmp_path / "restored"
    shutil.copytree(world.policy_dir, restored)
    generator.reload(restored, ENGINE_POLICY_VERSION)
