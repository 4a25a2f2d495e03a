"""Each CPU-rehearsal workaround: still needed (Megatron fails without it) and still working.

When a megatron-core upgrade removes a CUDA assumption, the "needed" test fails and says to
retire the workaround; when an upgrade moves the assumption, the "works" test fails.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deadpool_megatron.rehearsal import WORKAROUNDS, CpuRehearsal, prepare_megatron_import

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only workarounds")
TESTED = {
    "paged-stash-import", "cpu-rng-tracker", "recompute-rng-state",
    "sequence-parallel-torch-norm", "cuda-device-literals", "cuda-tensor-type-names",
    "cuda-streams", "cuda-synchronize", "cuda-seed-stack", "checkpoint-writer-fork", "batch-p2p-sync",
    "jit-fuser-off",
    "shared-gloo-groups", "typing-override", "megatron-lm-one-device",
    "megatron-lm-device-properties", "megatron-lm-ddp-stream", "megatron-lm-cuda-rng-state",
    "megatron-lm-load-torch-adam", "megatron-lm-data-iterator-draw",
}


@pytest.fixture(scope="module", autouse=True)
def megatron_world_of_one():
    """megatron.core imported and its parallel state set up for a one-process gloo world."""
    prepare_megatron_import()
    from megatron.core import parallel_state as ps

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_every_workaround_is_tested() -> None:
    assert {w.name for w in WORKAROUNDS} == TESTED


def test_recompute_rng_state_needed_and_works() -> None:
    """Megatron's activation recomputation (tensor_parallel.checkpoint) draws the forward's
    dropout mask again in the recomputed forward: the gradient flows exactly where the
    forward kept an element."""
    from megatron.core.tensor_parallel import random as mrandom

    x = torch.randn(256, requires_grad=True)

    def layer(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(t, 0.5, training=True) * 2

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        mrandom.checkpoint(layer, False, x)  # retire 'recompute-rng-state' if this passes
    with CpuRehearsal():
        torch.manual_seed(3)
        out = mrandom.checkpoint(layer, False, x)
        out.sum().backward()
    assert torch.equal(x.grad != 0, out.detach() != 0)
    assert 0 < int((out != 0).sum()) < 256  # a mask that could have differed


def test_sequence_parallel_torch_norm_needed_and_works() -> None:
    """The local spec's norm under --sequence-parallel: refused bare; with the workaround,
    torch's norm with its weights marked for the tensor-parallel gradient sum, the model's
    config untouched, and nothing marked without sequence parallelism."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    plain = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    config.sequence_parallel = True  # as with TP > 1 (validated at TP 1, so set after)
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config=config, hidden_size=8)  # retire the workaround if this passes
    with CpuRehearsal():
        norm = WrappedTorchNorm(config=config, hidden_size=8)
        unmarked = WrappedTorchNorm(config=plain, hidden_size=8)
    assert isinstance(norm, torch.nn.LayerNorm) and config.sequence_parallel
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert not any(getattr(p, "sequence_parallel", False) for p in unmarked.parameters())
    with pytest.raises(AssertionError):  # undone on exit
        WrappedTorchNorm(config=config, hidden_size=8)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180)


def test_paged_stash_import_needed_and_works() -> None:
    bare = _python("import megatron.core.pipeline_parallel.schedules")
    assert bare.returncode != 0 and "No module named 'triton'" in bare.stderr, (
        "megatron.core now imports without triton: retire 'paged-stash-import'"
    )
    stubbed = _python(
        "from deadpool_megatron.rehearsal import prepare_megatron_import\n"
        "assert prepare_megatron_import()\n"
        "import megatron.core.pipeline_parallel.schedules\n"
        "from megatron.core.transformer.moe.ops import paged_stash as p\n"
        "try:\n    p.paged_stash_copy_kernel()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    assert stubbed.returncode == 0, stubbed.stderr
    assert "needs triton" in stubbed.stdout


def test_typing_override_needed_and_works() -> None:
    probe = ("import sys\n"
             "from deadpool_megatron.rehearsal import prepare_megatron_import\n"
             "from deadpool_megatron.rehearsal.imports import provide_typing_override\n"
             "prepare_megatron_import(True)\n"
             "{}\n"
             "import megatron.training.models.gpt\n")
    bare = _python(probe.format("pass"))
    if sys.version_info >= (3, 12):
        assert bare.returncode == 0, bare.stderr
        pytest.skip("typing.override exists on this Python: 'typing-override' is a no-op")
    assert bare.returncode != 0 and "cannot import name 'override'" in bare.stderr, (
        "megatron/training imports without typing.override: retire 'typing-override'")
    fixed = _python(probe.format("assert provide_typing_override()"))
    assert fixed.returncode == 0, fixed.stderr


_MEGATRON_LM = ("import torch\n"
                "from deadpool_megatron.rehearsal import CpuRehearsal, prepare_megatron_import\n"
                "from deadpool_megatron.rehearsal.imports import provide_typing_override\n"
                "from deadpool_megatron.rehearsal.megatron_lm import MegatronLmOnCpu\n"
                "prepare_megatron_import(True)\n"
                "provide_typing_override()\n"
                "import megatron.training.training as training\n")


def test_megatron_lm_one_device_needed_and_works() -> None:
    probe = _python(_MEGATRON_LM + (
        "def attempt():\n"
        "    try:\n        training.initialize_megatron()\n"
        "    except AssertionError as e:\n        return str(e)\n"
        "print('bare:', attempt())\n"
        "with CpuRehearsal(), MegatronLmOnCpu():\n"
        "    print('shimmed:', attempt())\n"
        "    print('outside initialize:', torch.cuda.is_available())\n"
        "print('after:', training.initialize_megatron.__module__)\n"))
    assert probe.returncode == 0, probe.stderr
    assert "bare: Megatron requires CUDA." in probe.stdout, (
        "initialize_megatron no longer asserts CUDA: retire 'megatron-lm-one-device'")
    assert "shimmed: args is not initialized" in probe.stdout, probe.stdout
    assert "outside initialize: False" in probe.stdout
    assert "after: megatron.training.initialize" in probe.stdout, "the wrapper is undone"


def test_megatron_lm_device_properties_needed_and_work() -> None:
    probe = _python(_MEGATRON_LM + (
        "from megatron.training.utils.common_utils import get_device_arch_version\n"
        "try:\n    get_device_arch_version()\nexcept (AssertionError, RuntimeError) as e:\n"
        "    print('bare fails')\n"
        "with CpuRehearsal(), MegatronLmOnCpu():\n"
        "    print('arch', get_device_arch_version())\n"))
    assert probe.returncode == 0, probe.stderr
    assert "bare fails" in probe.stdout, "retire 'megatron-lm-device-properties'"
    assert "arch 9" in probe.stdout


def test_megatron_lm_ddp_stream_needed_and_works() -> None:
    probe = _python(_MEGATRON_LM + (
        "import inspect\n"
        "from megatron.training.models import dist_utils\n"
        "print('uses stream', 'torch.cuda.Stream()' in inspect.getsource(dist_utils._ddp_wrap))\n"
        "try:\n    torch.cuda.Stream()\nexcept RuntimeError:\n    print('bare fails')\n"
        "with CpuRehearsal(), MegatronLmOnCpu():\n"
        "    s = torch.cuda.Stream()\n"
        "    s.wait_stream(torch.cuda.current_stream())\n"
        "    with torch.cuda.stream(s):\n        print('stream ok')\n"))
    assert probe.returncode == 0, probe.stderr
    assert "uses stream True" in probe.stdout, "retire 'megatron-lm-ddp-stream'"
    assert "bare fails" in probe.stdout and "stream ok" in probe.stdout


def test_megatron_lm_cuda_rng_state_needed_and_works() -> None:
    probe = _python(_MEGATRON_LM + (
        "import inspect\n"
        "from megatron.training import checkpointing\n"
        "src = inspect.getsource(checkpointing)\n"
        "print('saves', 'torch.cuda.get_rng_state()' in src, "
        "'torch.cuda.set_rng_state(' in src)\n"
        "try:\n    torch.cuda.get_rng_state()\nexcept (AssertionError, RuntimeError):\n"
        "    print('bare fails')\n"
        "with CpuRehearsal(), MegatronLmOnCpu():\n"
        "    s = torch.cuda.get_rng_state()\n"
        "    torch.cuda.set_rng_state(s)\n"
        "    print('state', s.numel())\n"))
    assert probe.returncode == 0, probe.stderr
    assert "saves True True" in probe.stdout, "retire 'megatron-lm-cuda-rng-state'"
    assert "bare fails" in probe.stdout and "state 0" in probe.stdout


def test_megatron_lm_load_torch_adam_needed_and_works() -> None:
    """The two Megatron lines the load trips on, against a torch Adam before its first
    step; the full load is run by tests/test_megatron_lm_run.py."""
    probe = _python(_MEGATRON_LM + (
        "import inspect\n"
        "from megatron.core.optimizer import distrib_optimizer as d\n"
        "src = inspect.getsource(d.DistributedOptimizer)\n"
        "print('reads step', 'assert len(steps) == 1' in src, "
        "'dst_tensors[key].copy_(tensors[key])' in src)\n"
        "p = torch.nn.Parameter(torch.zeros(3))\n"
        "opt = torch.optim.Adam([p])\n"
        "print('state before step', len(opt.state_dict()['state']))\n"
        "try:\n    p.view(-1).copy_(torch.ones(3))\nexcept RuntimeError:\n"
        "    print('copy needs no_grad')\n"
        "from types import SimpleNamespace\n"
        "from deadpool_megatron.rehearsal.megatron_lm import _with_optimizer_state\n"
        "q = torch.nn.Parameter(torch.zeros(3))\n"
        "opt.add_param_group({'params': [q]})\n"
        "def load(model, optimizer):\n"
        "    p.view(-1).copy_(torch.ones(3))\n"
        "    sd = optimizer.optimizer.state_dict()\n"
        "    shared = torch.tensor(0.0)  # the pre-load value\n"
        "    for s in sd['state'].values():\n        s['step'] = shared\n"
        "    optimizer.optimizer.load_state_dict(sd)\n"
        "    st = optimizer.optimizer.state\n"
        "    print('tied by the load', st[p]['step'] is st[q]['step'])\n"
        "    return 2, sorted(sd['state'][0])\n"
        "print('loaded', _with_optimizer_state(load)(None, SimpleNamespace(optimizer=opt)))\n"
        "p.grad, q.grad = torch.ones(3), torch.ones(3)\n"
        "opt.step()\n"
        "print('steps', float(opt.state[p]['step']), float(opt.state[q]['step']))\n"))
    assert probe.returncode == 0, probe.stderr
    assert "reads step True True" in probe.stdout, "retire 'megatron-lm-load-torch-adam'"
    assert "state before step 0" in probe.stdout and "copy needs no_grad" in probe.stdout
    assert "loaded (2, ['exp_avg', 'exp_avg_sq', 'step'])" in probe.stdout, probe.stdout
    assert "tied by the load True" in probe.stdout, "torch now copies 'step' on load"
    assert "steps 3.0 3.0" in probe.stdout, probe.stdout


def test_megatron_lm_data_iterator_draw_needed_and_works() -> None:
    """The draw itself; that a resumed run with dropout is bit-exact is shown by
    tests/test_megatron_lm_run.py (dropout on)."""
    probe = _python(_MEGATRON_LM + (
        "import inspect\n"
        "src = inspect.getsource(training.build_train_valid_test_data_iterators)\n"
        "print('iter of a loader', 'RerunDataIterator(iter(dataloader))' in src)\n"
        "def build(provider):\n"
        "    return iter(torch.utils.data.DataLoader(list(range(4)))), None, None\n"
        "before = torch.get_rng_state()\n"
        "build(None)\n"
        "print('bare draws', not torch.equal(before, torch.get_rng_state()))\n"
        "original = training.build_train_valid_test_data_iterators\n"
        "with CpuRehearsal(), MegatronLmOnCpu():\n"
        "    wrapped = training.build_train_valid_test_data_iterators\n"
        "    print('wraps', wrapped.__wrapped__ is original)\n"
        "    from deadpool_megatron.rehearsal.megatron_lm import _leaving_dropout_generator\n"
        "    before = torch.get_rng_state()\n"
        "    _leaving_dropout_generator(build)(None)\n"
        "    print('shimmed draws', not torch.equal(before, torch.get_rng_state()))\n"
        "print('undone', training.build_train_valid_test_data_iterators is original)\n"))
    assert probe.returncode == 0, probe.stderr
    assert "iter of a loader True" in probe.stdout, "retire 'megatron-lm-data-iterator-draw'"
    assert "bare draws True" in probe.stdout, "retire 'megatron-lm-data-iterator-draw'"
    assert "wraps True" in probe.stdout and "shimmed draws False" in probe.stdout, probe.stdout
    assert "undone True" in probe.stdout


def test_jit_fuser_off_needed_and_works() -> None:
    probe = ("import torch\n"
             "from deadpool_megatron.rehearsal import prepare_megatron_import\n"
             "prepare_megatron_import({})\n"
             "import megatron.core.transformer.utils\n"
             "from megatron.core import jit\n"
             "print('compile' if jit.jit_fuser is torch.compile else "
             "'off' if jit.jit_fuser is jit.noop_decorator else jit.jit_fuser)\n")
    bare = _python(probe.format("False"))
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.strip() == "compile", (
        "megatron.core no longer uses torch.compile as its JIT fuser: retire 'jit-fuser-off'")
    off = _python(probe.format("True"))
    assert off.returncode == 0 and off.stdout.strip() == "off", off.stderr


def test_cpu_rng_tracker_needed_and_works() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    with pytest.raises((RuntimeError, AssertionError)):
        mrandom.CudaRNGStatesTracker().add("probe", 7)  # CUDA generator: absent on CPU torch
    with CpuRehearsal():
        mrandom.model_parallel_cuda_manual_seed(123)
        tracker = mrandom.get_cuda_rng_tracker()
        outside = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        with tracker.fork("data-parallel-rng"):
            b = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside)  # forks leave the default stream
        assert not torch.equal(a, b)  # distinct named streams
        mrandom.model_parallel_cuda_manual_seed(123)
        with mrandom.get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(4), a)  # reseeding reproduces the stream


def test_cuda_device_literals_needed_and_work() -> None:
    from megatron.core.utils import GlobalMemoryBuffer

    with pytest.raises((RuntimeError, AssertionError)):
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
    with CpuRehearsal():
        t = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "probe")
        assert t.device.type == "cpu" and t.shape == (2, 3)
        z = torch.zeros([], dtype=torch.int, device="cuda")
        assert z.device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"


def test_cuda_tensor_type_names_needed_and_work() -> None:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    def param_with_grad() -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 2.0)
        return p

    with pytest.raises(AssertionError):
        clip_grad_by_total_norm_fp32([param_with_grad()], max_norm=1.0, total_norm=4.0)
    with CpuRehearsal():
        p = param_with_grad()
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)
        assert p.type() == "torch.cuda.FloatTensor"
    assert param_with_grad().type() == "torch.FloatTensor"  # undone on exit


def test_cuda_streams_needed_and_work() -> None:
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_stream()
    with CpuRehearsal():
        stream = torch.cuda.current_stream()
        stream.wait_stream(stream)
        stream.wait_event(None)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_stream()  # restored


def test_cuda_synchronize_needed_and_works() -> None:
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.synchronize()
    with CpuRehearsal():
        torch.cuda.synchronize()


def test_cuda_seed_stack_needed_and_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeding CUDA without CUDA formats the caller's stack (kept for a CUDA start that never
    comes); inside the rehearsal it does nothing, and the CPU generator is seeded as ever."""
    import inspect
    import traceback

    from megatron.core.tensor_parallel import random as mrandom

    assert "torch.cuda.manual_seed(" in inspect.getsource(mrandom.model_parallel_cuda_manual_seed)
    formatted = []
    real = traceback.format_stack
    monkeypatch.setattr(traceback, "format_stack", lambda *a: formatted.append(1) or real(*a))
    torch.manual_seed(5)
    torch.cuda.manual_seed(5)
    seeded = len(formatted)
    assert seeded, "torch seeds CUDA lazily without a stack: retire 'cuda-seed-stack'"
    with CpuRehearsal():
        torch.manual_seed(7)
        torch.cuda.manual_seed(7)
        torch.cuda.manual_seed_all(7)
        assert torch.initial_seed() == 7
    assert len(formatted) == seeded
    torch.cuda.manual_seed(1)
    assert len(formatted) > seeded  # restored on exit


def test_checkpoint_writer_fork_needed_and_works() -> None:
    """Megatron asks for a spawned Manager (its server imports the training script again);
    inside the rehearsal the writer's queue comes from a forked one, which carries results
    and dies of SIGTERM although this process (as a worker does) catches it."""
    import inspect
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fs

    original = fs.get_write_results_queue
    assert inspect.signature(original).parameters["mp_mode"].default == "spawn"
    assert fs._results_queue is None  # made once per process: this test makes the first
    caught = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with CpuRehearsal():
            queue = fs.get_write_results_queue()  # as FileSystemWriterAsync calls it
            assert fs.get_write_results_queue() is queue
        assert fs.get_write_results_queue is original  # restored
        server = queue._manager._process
        assert type(server).__name__ == "ForkProcess", type(server)
        queue.put({"written": 1})
        assert queue.get(timeout=10) == {"written": 1}
        server.terminate()  # SIGTERM
        server.join(10)
        assert server.exitcode == -signal.SIGTERM, server.exitcode
    finally:
        signal.signal(signal.SIGTERM, caught)
        if fs._results_queue is not None and fs._results_queue._manager._process.is_alive():
            fs._results_queue._manager.shutdown()
        fs._results_queue = None


def test_batch_p2p_sync_switch_exists_and_is_used() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.integration.model import transformer_config

    assert "batch_p2p_sync" in TransformerConfig.__dataclass_fields__
    assert transformer_config(TrainConfig(), cpu_rehearsal=True).batch_p2p_sync is False
    assert transformer_config(TrainConfig(), cpu_rehearsal=False).batch_p2p_sync is True


SHARED_GROUPS = """
import torch.distributed as dist
from deadpool_megatron.rehearsal import prepare_megatron_import
from deadpool_megatron.reconstruct.spare import local_world
from deadpool_megatron.rehearsal.shared_groups import groups_shared_by_members
prepare_megatron_import(True)
from megatron.core import parallel_state as ps

def groups(shared):
    with local_world(5, 8):
        calls = []
        original = dist.new_group
        def counting(ranks=None, *a, **k):
            calls.append(tuple(sorted(ranks)))
            return original(ranks, *a, **k)
        dist.new_group = counting
        try:
            with groups_shared_by_members() if shared else __import__("contextlib").nullcontext():
                ps.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2,
                                             create_gloo_process_groups=False)
        finally:
            dist.new_group = original
        mine = [pg for pg in dist.distributed_c10d._world.pg_map if pg is not dist.group.WORLD]
        same = ps.get_tensor_model_parallel_group() is ps.get_expert_tensor_parallel_group()
        world = ps.get_intra_distributed_optimizer_instance_group() is dist.group.WORLD
        print(len(calls), len(set(calls)), len(mine), same, world)

groups(False)
groups(True)
"""


def test_shared_gloo_groups_needed_and_work() -> None:
    out = _python(SHARED_GROUPS)
    assert out.returncode == 0, out.stderr
    (calls, distinct, made, same, world), (_, _, made_shared, same_shared, world_shared) = (
        line.split() for line in out.stdout.split("\n")[:2])
    assert int(calls) > int(distinct), (
        "Megatron no longer makes groups with equal members: retire 'shared-gloo-groups'")
    assert same == "False" and int(made) > int(made_shared)
    assert same_shared == "True"
    # The distributed optimizer's instance group (the world, one instance) is the default
    # group, not a second full mesh of the world.
    assert world == "False" and world_shared == "True"


GLOO_COPIES = """
import socket
import torch.distributed as dist
from deadpool_megatron.rehearsal.shared_groups import groups_shared_by_members
from deadpool_megatron.reconstruct.spare import _register_local_backend

_register_local_backend()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
with groups_shared_by_members():
    plain = dist.new_group([0])
    copy = dist.new_group([0], backend="gloo")
    other = dist.new_group([0], backend="fake")
print(copy is plain, other is plain)
dist.destroy_process_group()

from deadpool_megatron.rehearsal import prepare_megatron_import
from deadpool_megatron.reconstruct.spare import local_world
prepare_megatron_import(True)
with local_world(1, 2), groups_shared_by_members():  # a spare's build: every group local
    plain = dist.new_group([0, 1])
    print(dist.new_group([0, 1], backend="gloo") is plain)
"""


def test_a_gloo_copy_is_the_default_group_where_gloo_is_the_default() -> None:
    """Megatron's `_GLOO` groups name gloo; in a gloo world they are its plain groups'
    twins and share them. A group asking for another backend stays apart. A spare's
    local world shares them too: its objects must hold the groups the generation it joins
    names (a `_GLOO` copy of its own would have no successor there)."""
    out = _python(GLOO_COPIES)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"], out.stdout
