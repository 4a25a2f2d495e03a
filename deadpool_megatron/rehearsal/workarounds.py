"""The catalogue of CPU-rehearsal workarounds: one entry per Megatron-Core CUDA assumption."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    """One named workaround; `sites` are megatron/core paths as of megatron-core 0.19.2."""

    name: str
    why: str
    sites: tuple[str, ...]


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        "paged-stash-import",
        "megatron.core imports MoE paged-stash Triton kernels unconditionally; CPU torch has no "
        "triton, so that one dense-unused module is replaced by a stub that raises if called.",
        ("transformer/moe/ops/paged_stash.py:4",),
    ),
    Workaround(
        "cpu-rng-tracker",
        "The tensor-parallel RNG tracker stores CUDA generator states; on CPU it keeps CPU "
        "generator states instead, seeded by Megatron's own model_parallel_cuda_manual_seed.",
        ("tensor_parallel/random.py:303-345",),
    ),
    Workaround(
        "recompute-rng-state",
        "Activation recomputation (--recompute-granularity) saves the CUDA generator's state "
        "before a checkpointed forward and sets it again for the recomputed one, so dropout "
        "draws the same masks; on CPU the generator dropout draws from is torch's default "
        "one, so those reads and writes go to it.",
        ("tensor_parallel/random.py:104-160,525-541",),
    ),
    Workaround(
        "sequence-parallel-torch-norm",
        "The local layer spec's norm (torch's LayerNorm/RMSNorm) asserts that sequence "
        "parallelism is off; apex's and TransformerEngine's norms allow it by marking their "
        "weights sequence_parallel, so finalize_model_grads sums their gradients over the "
        "tensor-parallel group. On CPU torch's norm is built the same way, with that mark.",
        ("transformer/torch_norm.py:50", "distributed/finalize_model_grads.py:452"),
    ),
    Workaround(
        "cuda-device-literals",
        "Buffers are allocated with device='cuda' or torch.cuda.current_device(); a torch "
        "function mode maps CUDA devices to the CPU and Tensor.cuda() to a no-op.",
        (
            "utils.py:715",
            "pipeline_parallel/p2p_communication.py:334",
            "distributed/param_and_grad_buffer.py:1180",
            "pipeline_parallel/schedules.py:749",
            "optimizer/optimizer.py:315",
            "optimizer/clip_grads.py:108",
            "models/common/language_module/language_module.py:307",
        ),
    ),
    Workaround(
        "cuda-tensor-type-names",
        "The optimizers classify parameters by Tensor.type() == 'torch.cuda.FloatTensor'; on "
        "CPU a no-argument Tensor.type() reports the CUDA name of the same dtype.",
        ("optimizer/distrib_optimizer.py:401,466,758", "optimizer/clip_grads.py:174"),
    ),
    Workaround(
        "cuda-streams",
        "Grad-buffer sync asks for torch.cuda.current_stream() every step; on CPU there is one "
        "implicit stream, so stream queries return a stand-in whose waits are no-ops.",
        ("distributed/param_and_grad_buffer.py:632",),
    ),
    Workaround(
        "cuda-synchronize",
        "dist_checkpointing's torch_dist save calls torch.cuda.synchronize() before writing; "
        "CPU ops complete before they return, so synchronize is a no-op on CPU.",
        ("dist_checkpointing/strategies/filesystem_async.py:248",),
    ),
    Workaround(
        "checkpoint-writer-fork",
        "The torch_dist writer's results queue is a Manager started with 'spawn', which "
        "imports the training script (Megatron, torch) again in a new process: seconds per "
        "rank at the first save, all ranks at once (14 s of an 8-rank job's on 2 cores). "
        "Without CUDA it is started with 'fork', as Megatron-LM's async saves ask for it.",
        ("dist_checkpointing/strategies/filesystem_async.py:53,200",),
    ),
    Workaround(
        "batch-p2p-sync",
        "Pipeline p2p calls torch.cuda.synchronize() after batched isend/irecv; Megatron's own "
        "switch batch_p2p_sync=False turns it off (gloo waits on its requests anyway).",
        ("pipeline_parallel/p2p_communication.py:419",),
    ),
    Workaround(
        "shared-gloo-groups",
        "Megatron makes ~20 process groups per rank, most with another's members; each gloo "
        "group polls in a thread of its own every 10 ms (20% of 2 cores' throughput) and "
        "costs a rendezvous per recovery; in CPU rehearsal groups with equal members share one.",
        ("parallel_state.py:232 create_group",),
    ),
    Workaround(
        "jit-fuser-off",
        "Megatron's JIT fuser is torch.compile, applied as modules load, which imports dynamo "
        "and inductor (~1.5 s of each process's start here) for fused kernels the dense CPU "
        "rehearsal never calls; Megatron's own disable_jit_fuser() runs as megatron.core.jit "
        "loads. (moe/router.py still imports dynamo through a direct @torch.compile.)",
        ("jit.py:21", "fusions/fused_bias_geglu.py:16", "transformer/moe/router.py:918"),
    ),
    Workaround(
        "typing-override",
        "megatron/training (Megatron-LM's own loop, patches/) imports typing.override, new in "
        "Python 3.12; on 3.11 typing_extensions.override, the same decorator, is put there.",
        ("../training/models/gpt.py:5", "../training/models/hybrid.py:5"),
    ),
    Workaround(
        "megatron-lm-one-device",
        "Megatron-LM's initialize_megatron asserts torch.cuda.is_available() and, with no "
        "device, skips initialize_model_parallel and the TP RNG seeding; inside it only, "
        "torch.cuda reports one device (set_device is a no-op on CPU).",
        ("../training/initialize.py:66", "../training/initialize.py:281,359"),
    ),
    Workaround(
        "cuda-seed-stack",
        "Megatron seeds CUDA's generators (torch.manual_seed, model_parallel_cuda_manual_seed); "
        "with CUDA (and XPU, MTIA) never initialised, torch keeps each seed for a later start "
        "together with the caller's formatted stack, reading every source file on it: about "
        "15 ms of a spare's 80 ms build alone (8 ranks). Without those devices there is no "
        "generator of theirs to seed, so their lazy seeders do nothing; CPU seeding is "
        "unchanged.",
        ("tensor_parallel/random.py:305,490", "../training/initialize.py:446",
         "torch/cuda/__init__.py:_lazy_call"),
    ),
    Workaround(
        "megatron-lm-device-properties",
        "validate_args reads the GPU architecture (get_device_arch_version) whenever TP > 1; "
        "on CPU a Hopper-like stand-in answers.",
        ("../training/arguments.py:1417", "../training/utils/common_utils.py:504"),
    ),
    Workaround(
        "megatron-lm-ddp-stream",
        "Megatron-LM wraps the model in DDP inside a new torch.cuda.Stream; on CPU the stream "
        "is the host stand-in and torch.cuda.stream() an empty context.",
        ("../training/models/dist_utils.py:303",),
    ),
    Workaround(
        "megatron-lm-cuda-rng-state",
        "Megatron-LM's checkpoints record torch.cuda.get_rng_state() and restore it; on CPU "
        "there is no CUDA generator (the CPU generator and the tracker states are saved "
        "beside it): an empty state, and restoring it is a no-op.",
        ("../training/checkpointing.py:417,2665,2677",),
    ),
    Workaround(
        "megatron-lm-load-torch-adam",
        "Loading a distributed-optimizer checkpoint into torch's Adam (no TransformerEngine or "
        "apex on CPU) reads an Adam step torch creates only at the first step, then copies "
        "into leaves that require grad, and hands every parameter one shared `step` tensor "
        "(the distributed optimizer's: the pre-load value, not the checkpoint's) that Adam "
        "increments once per parameter: the state is allocated as that step would, the load "
        "runs under no_grad, and each parameter gets a step of its own, the loaded iteration.",
        ("optimizer/distrib_optimizer.py:839,1030,1225",),
    ),
    Workaround(
        "megatron-lm-data-iterator-draw",
        "Making a DataLoader's iterator draws its workers' base seed from torch's default "
        "generator, which on CPU is also dropout's (CUDA's stand-in); pretrain() builds the "
        "iterators after load_checkpoint restored the generators, so a resumed run's dropout "
        "masks were one draw ahead of the uninterrupted run's. The build leaves the generator "
        "as it found it, as it leaves CUDA's on a GPU.",
        ("../training/training.py:1228,1361,4617", "torch/utils/data/dataloader.py:690"),
    ),
)
