"""What a run trains, built from its config: the accelerator, the policy (+ frozen reference,
+ PPO's critic), their AdamW optimizers and learning-rate schedules, and their checkpoint
state. `labkit.trainer` builds one per run and steps it."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.formulas.estimators import ESTIMATORS
from labkit.model import parallel
from labkit.model.models import load, resolve_device
from labkit.model.scoring import FAST_PASSES, MODEL_PASSES, Passes, ValueModel
from labkit.run import rundir
from labkit.settings.config import TrainConfig


@dataclass
class Learner:
    """What one step updates: the policy (and PPO's critic), their optimizers and schedules."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    accelerator: object
    reference: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: object = None
    passes: Passes = FAST_PASSES
    """How the policy, the reference and the critic run (`TrainConfig.fast`)."""
    beta: float = 0.0
    """The KL coefficient now: config.beta, moved by the adaptive controller (kl_target)."""
    reference_moves: bool = False
    """Whether the reference moves during the run (ref_sync_every): checkpoints keep it."""

    @property
    def processes(self) -> int:
        """How many processes train together (1 unless launched by `accelerate launch`)."""
        return self.accelerator.num_processes


def lr_schedule(config: TrainConfig) -> Callable[[int], float]:
    """Learning-rate multiplier per optimizer step: linear warmup, then cosine or constant."""
    total, warm = config.optimizer_steps, config.warmup_steps

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def make_accelerator(config: TrainConfig):
    """An `accelerate.Accelerator` on `config.device`, bf16 autocast where `config.precision`
    asks for it ("auto": bf16 on a CUDA device that computes it natively, else fp32)."""
    from accelerate import Accelerator

    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    mixed = "bf16" if resolve_precision(config.precision, device) == "bf16" else "no"
    _forget_other_precision(mixed)
    accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=mixed)
    parallel.leave_at_exit()  # a distributed launch: the process group goes before the exit
    return accelerator


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run computes its update in: `precision`, or for "auto" bf16 on a CUDA
    device that computes it natively and fp32 elsewhere."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def cpu_bf16_native() -> bool:
    """Whether this CPU computes bf16 products in hardware (x86 AVX512_BF16 or AMX-BF16, Arm
    BF16), read from /proc/cpuinfo on Linux and sysctl on macOS; elsewhere False. Without
    it torch emulates bf16 on the CPU, slower than fp32. On x86 the kernels torch runs must
    also reach it: False when they are held below AVX-512
    (`torch.backends.cpu.get_cpu_capability()`, set by `ATEN_CPU_CAPABILITY`) or oneDNN's
    below its bf16 level (`ONEDNN_MAX_CPU_ISA`)."""
    import platform
    import subprocess
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = set()
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("flags", "features")):
                flags |= set(line.partition(":")[2].split())
        if flags & {"avx512_bf16", "amx_bf16"}:
            return _x86_kernels_reach_bf16()
        return "bf16" in flags
    if platform.system() == "Darwin":
        try:
            found = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return False
        return found == "1"
    return False


ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                            "AVX512_CORE_VNNI"}
"""`ONEDNN_MAX_CPU_ISA` values that hold oneDNN below AVX512_CORE_BF16, its first level with
bf16 products."""


def _x86_kernels_reach_bf16() -> bool:
    import os

    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() not in ONEDNN_ISAS_WITHOUT_BF16


def machine(config: TrainConfig) -> dict:
    """What a run's numbers depend on beyond its config, for config.json: the device, the
    CPU's model and kernel capability (AVX2 and AVX-512 kernels round differently), torch's CPU threads
    (they split the products' sums) and the precision the update runs in."""
    device = resolve_device(config.device)
    return {"device": str(device), "cpu_model": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16_native": cpu_bf16_native(), "threads": torch.get_num_threads(),
            "precision": resolve_precision(config.precision, device)}


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14 96-Core Processor"): Linux's /proc/cpuinfo, else
    what the platform module knows ("" when nothing)."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or ""


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB, on the platform it runs on: ru_maxrss is
    KiB on Linux and bytes on macOS; Windows has no `resource` module and reads the peak
    working set through psutil (a dependency there)."""
    import sys

    if sys.platform == "win32":
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _forget_other_precision(mixed: str) -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator with another
    mixed precision (a notebook that runs an fp32 run, then a bf16 one). In a single process
    that state holds nothing a finished run needs, so it is cleared; a distributed launch
    keeps its state (and its launcher's precision)."""
    from accelerate.state import AcceleratorState, PartialState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", mixed) != mixed \
            and PartialState().num_processes == 1:
        AcceleratorState._reset_state()


def _cpu_bf16_attention(model) -> None:
    """Eager attention for bf16 autocast on a CPU: torch's fused attention kernels run bf16
    slower there than plain matmul + softmax at a rollout's shapes (one query over a few
    hundred cached keys), and the step follows (`python -m labkit bench`). Same numbers up
    to bf16 rounding."""
    if model is None or not hasattr(model, "set_attn_implementation"):
        return
    try:
        model.set_attn_implementation("eager")
    except (ValueError, ImportError):  # an architecture without it keeps its own
        pass


def trainable(parameters) -> list[torch.Tensor]:
    """The parameters an optimizer updates: those that require a gradient (with LoRA, the
    adapters and PPO's value head)."""
    return [p for p in parameters if p.requires_grad]


def adamw(parameters, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one call per step, not a dozen operations per
    parameter tensor) where this torch has it for the parameters' device; the same update."""
    parameters = list(parameters)
    try:
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)


FULL_KL_MAX_BYTES = 4 << 30
"""kl_kind="full" refuses a step whose stored log-distributions would exceed this."""


def check_full_kl_memory(config: TrainConfig, vocab: int) -> None:
    """kl_kind="full" keeps the reference's log-distribution over the vocabulary for every
    completion token of a step (fp32, rows x max_new_tokens x V), and the sampling policy's
    too when the KL is in the reward or beta adapts: refuse a step that would hold more
    than FULL_KL_MAX_BYTES, before any model runs."""
    copies = 2 if config.kl_place == "reward" or config.kl_target is not None else 1
    need = copies * config.rows * config.max_new_tokens * vocab * 4
    if need > FULL_KL_MAX_BYTES:
        raise ValueError(
            f"kl_kind='full' would hold {need / 2**30:.1f} GiB of log-distributions a step "
            f"({copies} x rows {config.rows} x max_new_tokens {config.max_new_tokens} x "
            f"vocabulary {vocab} x 4 bytes; limit {FULL_KL_MAX_BYTES / 2**30:.0f} GiB): use a "
            "sampled estimator (k3, k2, k1) or fewer rows or tokens")


def say_slow_path(model: str, policy) -> None:
    """One line on stderr where `policy` falls off labkit.fast's passes (an architecture or
    setting they do not run, such as Mistral's sliding window): its own forward runs."""
    from labkit.fast.support import unsupported

    reason = unsupported(policy)
    if reason is not None:
        print(f"note: model={model!r} runs its own forward, not labkit.fast's: {reason} "
              "(the same numbers, more time per call)", file=sys.stderr)


def build_learner(config: TrainConfig, accelerator):
    """Policy (+ frozen reference when beta > 0 or for DPO, + a critic when the estimator reads its
    values: PPO's gae), optimizers, schedules."""
    if config.fast and accelerator.device.type == "cpu":
        # the fast wing, loaded only when a run asks for it: a step's tensors reuse the heap
        from labkit.fast.allocator import keep_freed_memory

        keep_freed_memory()
    policy, tokenizer = load(config.model, device=accelerator.device, dtype="fp32")
    if not config.chat_template:  # every prompt site reads the tokenizer's template
        tokenizer.chat_template = None
    if config.fast and config.model is not None:
        say_slow_path(config.model, policy)
    reference = None
    if config.beta > 0 and config.kl_estimator == "full":
        check_full_kl_memory(config, policy.get_output_embeddings().weight.shape[0])
    if config.has_reference and not config.lora_rank:
        # frozen: under bf16 autocast its products run in bf16 anyway, so it is held in bf16
        # (half the memory); only its norm weights round differently from an fp32 copy
        held = "bf16" if accelerator.mixed_precision == "bf16" else "fp32"
        reference, _ = load(config.model, device=accelerator.device, dtype=held)
        reference.requires_grad_(False)
    if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16":
        for model in (policy, reference):
            _cpu_bf16_attention(model)
    passes = FAST_PASSES if config.fast else MODEL_PASSES
    critic = None
    if "values" in ESTIMATORS.needs(config.estimator):  # from the policy as loaded: its own
        # backbone, its own adapters
        critic = ValueModel(policy, hidden=passes.hidden)
    if config.lora_rank:
        from labkit.model import lora

        lora.add_adapters(policy, config)
        if config.has_reference:
            reference = lora.AdaptersOff(policy)  # the base model: the policy, adapters off
        if critic is not None:
            lora.add_adapters(critic.backbone, config)  # freezes the backbone, not the head
    factor = lr_schedule(config)
    optimizer = adamw(trainable(policy.parameters()), config.lr, config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    policy.train()
    if critic is not None:
        critic.train()
        critic_optimizer = adamw(trainable(critic.parameters()), config.critic_lr,
                                 config.weight_decay)
        critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, factor)
        policy, optimizer, scheduler, critic, critic_optimizer, critic_scheduler = \
            _prepare(accelerator, policy, optimizer, scheduler, critic, critic_optimizer,
                     critic_scheduler)
        learner = Learner(policy, optimizer, scheduler, accelerator, reference, critic,
                          critic_optimizer, critic_scheduler, passes, beta=config.beta)
    else:
        policy, optimizer, scheduler = _prepare(accelerator, policy, optimizer, scheduler)
        learner = Learner(policy, optimizer, scheduler, accelerator, reference, passes=passes,
                          beta=config.beta)
    learner.reference_moves = bool(config.ref_sync_every)
    return learner, tokenizer


def _prepare(accelerator, *objects):
    """`accelerator.prepare` for one process. On several, the models are prepared without
    DistributedDataParallel (`labkit.model.parallel` sums the gradients itself, once per optimizer
    step) and the schedules are left as they are (accelerate's wrapper would step them once
    per process)."""
    if accelerator.num_processes == 1:
        return accelerator.prepare(*objects)
    out = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            obj = accelerator.prepare_model(obj, evaluation_mode=True)
        elif isinstance(obj, torch.optim.Optimizer):
            obj = accelerator.prepare_optimizer(obj)
        out.append(obj)
    return tuple(out)


def learner_state(learner: Learner) -> dict:
    """The weights, optimizer and schedule states a checkpoint holds (the policy's and, for
    PPO, the critic's; a moving reference's), and the KL coefficient as the adaptive
    controller left it."""
    acc = learner.accelerator
    state = {"policy": _weights(acc.unwrap_model(learner.policy)),
             "optimizer": learner.optimizer.state_dict(),
             "scheduler": learner.scheduler.state_dict(), "beta": learner.beta}
    if learner.reference_moves:  # iterative GRPO: the reference is no longer the model's
        state["reference"] = learner.reference.state_dict()
    if learner.critic is not None:
        state |= {"critic": _weights(acc.unwrap_model(learner.critic)),
                  "critic_optimizer": learner.critic_optimizer.state_dict(),
                  "critic_scheduler": learner.critic_scheduler.state_dict()}
    return state


def _weights(model) -> dict:
    """What a checkpoint keeps of a model: every weight, or with LoRA adapters the weights
    that train (the adapters, and a critic's value head); the frozen base is the model's."""
    if not any(not p.requires_grad for p in model.parameters()):
        return model.state_dict()
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def _load_weights(model, state: dict) -> None:
    """Load `_weights`: a whole state dict strictly; a trained subset (LoRA) must cover
    every weight that trains."""
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    if len(names) == len(list(model.parameters())):
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    missing = sorted(names & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint's trained weights do not fit this model: missing "
                         f"{missing[:3]}, unexpected {result.unexpected_keys[:3]} (a LoRA "
                         "checkpoint resumes with the same lora_rank and lora_targets)")


def restore_learner(learner: Learner, state: dict) -> None:
    """Load a checkpoint's `learner_state` and its random-number generators' states."""
    acc = learner.accelerator
    _load_weights(acc.unwrap_model(learner.policy), state["policy"])
    learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.beta = state.get("beta", learner.beta)  # older checkpoints: the config's beta
    if learner.reference_moves:
        if "reference" not in state:
            raise ValueError("the checkpoint holds no reference weights, which a run with "
                             "ref_sync_every needs to resume (it was saved without syncs)")
        learner.reference.load_state_dict(state["reference"])
    if learner.critic is not None:
        _load_weights(acc.unwrap_model(learner.critic), state["critic"])
        learner.critic_optimizer.load_state_dict(state["critic_optimizer"])
        learner.critic_scheduler.load_state_dict(state["critic_scheduler"])
    rundir.set_rng_state(state["rng"])


def update_count(learner: Learner) -> int:
    """Optimizer steps taken so far, from the scheduler, which steps with the optimizer."""
    return int(learner.scheduler.state_dict()["last_epoch"])
