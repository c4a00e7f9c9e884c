"""What a run or a benchmark ran on, recorded with every figure: speed and float rounding depend on it.

Importing this module imports no torch (the functions that need it import it): reading run records does not."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moekit.utils.allocator import active_allocator
from moekit.utils.openmp import spin_setting

if TYPE_CHECKING:
    import torch

__all__ = [
    "available_memory",
    "check_fits_in_memory",
    "check_accelerator",
    "cpu_model",
    "cpu_flags",
    "resolve_precision",
    "trains_on_cuda",
    "BF16_DOT_PRODUCTS",
    "BF16_MARGIN",
    "bf16_in_hardware",
    "cpu_bf16_pays",
    "machine_info",
    "machine_label",
]


def _binary(size: int) -> str:
    """``8.0 MiB``, ``488.3 GiB``: a byte count in binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def check_fits_in_memory(needed: int, device: torch.device | str | None, what: str, fix: str) -> None:
    """Refuse ``needed`` bytes of new tensors that exceed the memory ``device`` has left, saying how much
    ``what`` needs, instead of an allocation failure (or the kernel's OOM killer) deep inside model
    construction. Nothing is checked where the free memory cannot be known."""
    import torch

    available = available_memory(device)
    if available is not None and needed > available:
        raise ValueError(
            f"{what} need {_binary(needed)} for the weights alone (training with AdamW about 4x: gradients and "
            f"two moments), but {_binary(available)} are available on {torch.device(device or 'cpu')}; {fix}"
        )


def check_accelerator(accelerator: str, devices: Any = "auto") -> None:
    """Refuse ``trainer.accelerator`` / ``trainer.devices`` that this machine does not have, naming them and
    the fix (Lightning says "No supported gpu backend found!")."""
    import torch

    accelerator = str(accelerator).lower()
    if accelerator in ("gpu", "cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(
                f"trainer.accelerator={accelerator} but this machine has no CUDA GPU (torch {torch.__version__}, "
                f"{build}); use trainer=cpu here, or run on a machine with a GPU"
            )
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > count:
            raise ValueError(
                f"trainer.devices={devices} but this machine has {count} GPU(s); use trainer.devices={count} or fewer"
            )
    elif accelerator == "mps" and not torch.backends.mps.is_available():
        raise ValueError("trainer.accelerator=mps but this machine has no Apple GPU (MPS); use trainer=cpu")


def available_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes that new tensors on ``device`` can still take: a CUDA device's free memory, or for the CPU the host's
    ``MemAvailable`` (Linux), less where the process's cgroup (a container's, a batch job's) has a memory limit nearer
    (:func:`_cgroup_memory_left`); None where it cannot be known (other devices and systems)."""
    import torch

    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    host = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_memory_left()
    return host if cgroup is None else cgroup if host is None else min(host, cgroup)


_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page multiple below 2**63


def _cgroup_memory_left() -> int | None:
    """What the memory cgroups of this process (its own and those above it that are visible) still let it use: the
    smallest limit less usage, counting the file cache as free (the kernel reclaims it before it kills; not shared
    memory, which it cannot drop); None without a limit or on a system without cgroups. cgroup v2 (``memory.max``)
    and v1 (``memory.limit_in_bytes``); a container sees its own cgroup at the mount's root."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    left = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            root, limit, usage, cache, shared = _CGROUP_ROOT, "memory.max", "memory.current", "file", "shmem"
        elif "memory" in parts[1].split(","):
            root, limit, usage = _CGROUP_ROOT / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache, shared = "total_cache", "total_shmem"
        else:
            continue
        folder = root / parts[2].strip("/")
        folder = folder if folder.is_dir() else root
        for level in (folder, *(p for p in folder.parents if p.is_relative_to(root))):
            try:
                cap = (level / limit).read_text().strip()
                if cap == "max" or int(cap) >= _UNLIMITED:
                    continue
                used = int((level / usage).read_text())
            except (OSError, ValueError):
                continue
            try:
                rows = (row.split() for row in (level / "memory.stat").read_text().splitlines())
                stat = {row[0]: int(row[1]) for row in rows if len(row) == 2}
                used -= stat.get(cache, 0) - stat.get(shared, 0)
            except (OSError, ValueError):
                pass
            room = max(int(cap) - used, 0)
            left = room if left is None else min(left, room)
    return left


_CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in _CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():  # the first processor's block ends
                break
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_family() -> str | None:
    """An x86 CPU's vendor and family, ``"AMD family 26"`` (Zen 5), ``"Intel family 6"``; None elsewhere."""
    fields = _cpuinfo_fields()
    if "cpu family" not in fields:
        return None
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(fields.get("vendor_id", ""), fields.get("vendor_id"))
    return f"{vendor or 'unknown'} family {fields['cpu family']}"


def cpu_model() -> str:
    """The CPU's marketing name from ``/proc/cpuinfo`` with its x86 family and model, ``"AMD EPYC (family 23 model
    1)"``: a virtual machine's name is often the vendor's brand alone, the same for CPUs of twice the speed (a Zen 1
    and a Zen 4 EPYC); an ARM CPU, which Linux gives no name, by its implementer and part (``"ARM CPU (implementer
    0x41 part 0xd40)"``: a Neoverse V1); ``platform.processor()`` where there is no ``/proc/cpuinfo``."""
    fields = _cpuinfo_fields()
    if "model name" not in fields and "CPU implementer" in fields:
        return f"ARM CPU (implementer {fields['CPU implementer']} part {fields.get('CPU part', 'unknown')})"
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (x86's ``flags``, ARM's ``Features``; empty where it cannot be
    read)."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def trains_on_cuda(accelerator: Any) -> bool:
    """Whether Lightning's ``accelerator`` setting puts training on a CUDA GPU (``auto``: where one is present)."""
    import torch

    accelerator = str(accelerator).lower()
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


BF16_DOT_PRODUCTS = frozenset({"amx_bf16", "avx512_bf16"})
"""CPU flags of bf16 dot products in hardware. Without one, oneDNN emulates bf16 matmuls (0.2 GFLOP/s on a
first-generation AMD EPYC, against 70 in float32)."""


def bf16_in_hardware(device_type: str) -> bool:
    """Whether bf16 matmuls run in hardware on this machine's ``device_type``: a CUDA GPU of compute capability 8.0
    on (``is_bf16_supported()`` on its own also accepts the emulation older GPUs, V100 and T4, offer, which trains
    slower than float16), a CPU with bf16 dot products (:data:`BF16_DOT_PRODUCTS`)."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and bool(BF16_DOT_PRODUCTS & cpu_flags())


def cpu_bf16_pays(flags: set[str] | None = None) -> bool | None:
    """Whether bf16 matmuls outrun float32 ones on a CPU of ``flags`` (this CPU's by default): True with AMX (bf16
    matrix units), False without bf16 dot products (emulated), None with ``avx512_bf16`` alone, where only a
    measurement tells (a Zen 4 EPYC trained 1.7x faster in bf16, a Xeon 1.67x slower)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return True
    return None if BF16_DOT_PRODUCTS & flags else False


BF16_MARGIN = 1.1
"""How much faster than float32 a measured bf16 autocast step must be for ``auto`` to choose it: float32 is the
more accurate, and a smaller gain is within a measurement's noise."""


def resolve_precision(
    precision: Any,
    accelerator: Any = "auto",
    flags: set[str] | None = None,
    measure: Callable[[], Mapping[str, float]] | None = None,
) -> tuple[str, str]:
    """``trainer.precision``, with ``auto`` replaced by what this machine trains fastest in: ``(value, why)``.

    On a CUDA GPU ``bf16-mixed`` (``16-mixed`` without bf16 support). On a CPU:

    - with AMX (``amx_bf16``, bf16 matrix units) ``bf16-mixed``;
    - without bf16 dot products (neither AMX nor ``avx512_bf16``) ``32-true``;
    - with ``avx512_bf16`` alone it depends on the CPU: bf16 autocast trained the main job 1.7x faster than float32
      on a Zen 4 EPYC and 1.67x slower on a Xeon. ``measure()`` times the run's training step both ways (seconds
      by precision: ``{"32-true": ..., "bf16-mixed": ...}``), and ``bf16-mixed`` is chosen where it is at least
      :data:`BF16_MARGIN` times faster (an infinite bf16 time: it failed). Without ``measure``, ``32-true``.

    Other values pass through.
    """
    import torch

    if str(precision) != "auto":
        return str(precision), "as configured"
    if trains_on_cuda(accelerator):
        if torch.cuda.is_available() and not bf16_in_hardware("cuda"):
            return "16-mixed", f"{torch.cuda.get_device_name()} has no bf16"
        return "bf16-mixed", "a CUDA GPU: bf16 autocast"
    pays, cpu = cpu_bf16_pays(flags), cpu_model()
    if pays:
        return "bf16-mixed", f"{cpu} has AMX (bf16 matrix units)"
    if pays is False:
        return "32-true", f"{cpu} has no bf16 dot products, where bf16 autocast runs far slower than float32"
    if measure is None:
        return "32-true", f"{cpu} has bf16 dot products without AMX; not measured, float32"
    seconds = measure()
    full, bf16 = seconds["32-true"], seconds["bf16-mixed"]
    if not math.isfinite(bf16):
        return "32-true", f"{cpu} has bf16 dot products without AMX; bf16 autocast failed when measured, float32"
    faster = bf16 * BF16_MARGIN <= full
    return "bf16-mixed" if faster else "32-true", (
        f"{cpu} has bf16 dot products without AMX; measured, a training step's forward and backward took "
        f"{bf16 * 1e3:.0f} ms in bf16 autocast against {full * 1e3:.0f} ms in float32 ({full / bf16:.2f}x"
        f"{'' if faster else f', under the {BF16_MARGIN}x that bf16 must gain'})"
    )


def machine_info() -> dict[str, Any]:
    """What a run ran on: CPU model, logical cores (all, and those this process may use), torch
    threads, torch / Python versions, the OS, the memory allocator, OpenMP's idle spin, whether the CPU has bf16
    matrix units (AMX) and bf16 dot products, the library of its float32 products (:mod:`moekit.moe.cpu_matmul`), and
    the GPU's name (None without CUDA)."""
    import torch

    from moekit.moe.cpu_matmul import float32_library

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = cpu_flags()
    return {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "allocator": active_allocator(),
        "openmp_spin": spin_setting(),
        "cpu_amx": "amx_bf16" in flags,
        "cpu_bf16_dot_products": bool(BF16_DOT_PRODUCTS & flags),
        "cpu_float32_matmul": dict(zip(("library", "reason"), float32_library())),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def machine_label(machine: Mapping[str, Any]) -> str:
    """``"AMD EPYC, 1 torch thread"`` (``, NVIDIA H100 x1`` with a GPU) from :func:`machine_info`'s dict:
    what decides a run's speed, and its float rounding (one machine and thread count repeats a seeded
    run bit for bit; another gives another draw)."""
    threads = machine.get("torch_threads")
    label = f"{machine.get('cpu', 'unknown CPU')}, {threads} torch thread{'s' if threads != 1 else ''}"
    if machine.get("gpu"):
        label += f", {machine['gpu']} x{machine.get('gpu_count', 1)}"
    return label
