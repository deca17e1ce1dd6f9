"""The CUDA devices of this machine (name, memory), read without importing torch or
creating a CUDA context; and that context started early (:func:`start_cuda_context`).

``hisparse run`` needs the device count and memory before anything else (``--preset
auto`` and the device checks). Asking torch costs its import (1-2 s) plus the CUDA
driver's initialisation, all before the first byte of the model is read (3.2 s on an
H200, docs/performance.md "Start-up to the first prefill"). The sources, in order:

1. **NVML** through ``ctypes`` on ``libnvidia-ml.so.1`` (the library the driver installs):
   ``nvmlInit_v2``, ``nvmlDeviceGetCount_v2``, ``nvmlDeviceGetHandleByIndex_v2``,
   ``nvmlDeviceGetName``, ``nvmlDeviceGetUUID``, ``nvmlDeviceGetMemoryInfo_v2`` (falling
   back to ``nvmlDeviceGetMemoryInfo``) and ``nvmlDeviceGetMigMode`` — a small, documented
   C API (https://docs.nvidia.com/deploy/nvml-api/). Not ``pynvml`` (``nvidia-ml-py``):
   it is not a core dependency, and these seven calls are all that is needed. NVML is
   left initialised (no ``nvmlShutdown``): on a GPU without persistence mode the driver
   tears the device state down when its last client closes, and CUDA would pay to set it
   up again a second later.
2. ``nvidia-smi --query-gpu=...`` (the same library behind a process, ~0.1 s more).
3. torch (``torch.cuda.device_count`` and ``get_device_properties``), the reference the
   other two reproduce, when neither can answer or their answer could differ from CUDA's:
   MIG enabled, ``MIG-`` entries in ``CUDA_VISIBLE_DEVICES``, or cards that are not all
   the same while ``CUDA_DEVICE_ORDER`` is not ``PCI_BUS_ID`` (CUDA then numbers the
   fastest card first; NVML numbers by PCI bus).

NVML ignores ``CUDA_VISIBLE_DEVICES``; :func:`visible_selection` reads it the way torch
does (``torch.cuda._parse_visible_devices``, the rules of CUDA's own parser): unset = all
devices; comma-separated indices, each read like ``strtoul`` (``1gpu`` = 1), the first
negative or unreadable one ending the list (``-1`` or an empty string: no device); a
repeated index = no device; or ``GPU-`` UUID prefixes, each matching exactly one device
(the first that matches none or several ends the list). An index past the last device
ends the list too.

Memory is what CUDA reports as the device's total (``cudaDeviceProp.totalGlobalMem``):
NVML's total less the memory the driver and firmware reserve (``nvmlMemory_v2_t.reserved``;
with only the v1 call, the total itself, ~0.5 GiB more).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

NVML_LIBRARY = "libnvidia-ml.so.1"
SMI_FIELDS = "index,uuid,name,memory.total,memory.reserved,mig.mode.current"
_NVML_MEMORY_V2 = 40 | (2 << 24)  # nvmlMemory_v2 = sizeof(nvmlMemory_v2_t) | 2 << 24 (nvml.h)
_NVML_SUCCESS, _NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND = 0, 3, 13
_MIB = 2**20


class ProbeFailed(Exception):
    """A source could not read the devices, or its answer could differ from CUDA's; the
    message says why (shown in the probe's ``note``)."""


class DiffersFromCuda(ProbeFailed):
    """NVML's (and so ``nvidia-smi``'s) list could differ from CUDA's here: torch decides."""


@dataclass(frozen=True)
class PhysicalDevice:
    """One GPU as NVML or ``nvidia-smi`` lists it (all GPUs, PCI bus order).

    total_bytes : NVML's total memory; reserved_bytes : the driver's and firmware's share
    (``None`` where the source cannot say); mig : MIG mode is enabled.
    """

    name: str
    uuid: str
    total_bytes: int
    reserved_bytes: int | None
    mig: bool = False

    @property
    def cuda_total_bytes(self) -> int:
        """Total memory as CUDA reports it (NVML's total less the reserved share)."""
        return self.total_bytes - (self.reserved_bytes or 0)


@dataclass(frozen=True)
class CudaDevice:
    """One device as CUDA numbers it here (``cuda:N`` is the N-th); memory in GiB."""

    name: str
    memory_gib: float


@dataclass(frozen=True)
class CudaDevices:
    """What :func:`probe_cuda_devices` found.

    devices : ``cuda:0``, ``cuda:1``, ... as CUDA numbers them in this process
    source : ``nvml``, ``nvidia-smi`` or ``torch`` (whichever answered)
    note : why earlier sources were passed over (empty when the first one answered)
    seconds : how long the probe took
    """

    devices: tuple[CudaDevice, ...]
    source: str
    note: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        """One line: ``read through NVML in 0.03 s`` (+ the note)."""
        how = {"nvml": "NVML", "nvidia-smi": "nvidia-smi", "torch": "torch"}.get(
            self.source, self.source
        )
        text = f"read through {how} in {self.seconds:.2f} s"
        return f"{text} ({self.note})" if self.note else text


Selection = list[int] | list[str] | None


def visible_selection(value: str | None) -> Selection:
    """``CUDA_VISIBLE_DEVICES`` as torch reads it: ``None`` (unset: every device), device
    indices, or ``GPU-`` UUID prefixes; ``[]`` hides every device.

    Raises
    ------
    DiffersFromCuda
        ``MIG-`` entries (MIG instances are not NVML devices; torch decides).
    """
    if value is None:
        return None
    if value.startswith("MIG-"):
        raise DiffersFromCuda("CUDA_VISIBLE_DEVICES names MIG instances")
    if value.startswith("GPU-"):
        prefixes: list[str] = []
        for entry in value.split(","):
            if entry in prefixes:
                return []
            if not entry.startswith("GPU-"):
                break
            prefixes.append(entry)
        return prefixes
    indices: list[int] = []
    for entry in value.split(","):
        index = _strtoul(entry.strip())
        if index in indices:
            return []
        if index < 0:
            break
        indices.append(index)
    return indices


def _strtoul(text: str) -> int:
    """The integer ``text`` starts with (an optional sign, then digits), else -1."""
    end = 0
    while end < len(text) and (text[end].isdigit() or (end == 0 and text[end] in "+-")):
        end += 1
    try:
        return int(text[:end])
    except ValueError:
        return -1


def select_visible(
    physical: Sequence[PhysicalDevice], env: Mapping[str, str]
) -> tuple[CudaDevice, ...]:
    """The devices CUDA shows in a process with environment ``env``, in its order.

    Raises
    ------
    DiffersFromCuda
        MIG enabled on a selected GPU, ``MIG-`` entries, or cards that differ while
        ``CUDA_DEVICE_ORDER`` is not ``PCI_BUS_ID`` and the selection is by index.
    """
    selection = visible_selection(env.get("CUDA_VISIBLE_DEVICES"))
    if selection is None or (selection and isinstance(selection[0], int)):
        kinds = {(d.name, d.cuda_total_bytes) for d in physical}
        if len(kinds) > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            raise DiffersFromCuda(
                "the cards differ and CUDA numbers the fastest first "
                "(CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them as NVML does)"
            )
        indices = range(len(physical)) if selection is None else selection
        chosen = []
        for index in indices:
            if index >= len(physical):
                break
            chosen.append(physical[index])
    else:
        chosen = _by_uuid(physical, selection)
    if any(d.mig for d in chosen):
        raise DiffersFromCuda("MIG is enabled")
    return tuple(CudaDevice(d.name, d.cuda_total_bytes / 2**30) for d in chosen)


def _by_uuid(physical: Sequence[PhysicalDevice], prefixes: Sequence[str]) -> list[PhysicalDevice]:
    """The devices the UUID prefixes name (torch's ``_transform_uuid_to_ordinals``)."""
    chosen: list[PhysicalDevice] = []
    for prefix in prefixes:
        matches = [d for d in physical if d.uuid.startswith(str(prefix))]
        if len(matches) != 1:
            break
        if matches[0] in chosen:
            return []
        chosen.append(matches[0])
    return chosen


# ----------------------------------------------------------------------------- sources


class _NvmlMemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def load_nvml() -> ctypes.CDLL:
    """``libnvidia-ml.so.1`` (tests replace this loader). Raises ``OSError`` if absent."""
    return ctypes.CDLL(NVML_LIBRARY)


def read_nvml(loader: Callable[[], object] = load_nvml) -> list[PhysicalDevice]:
    """Every GPU NVML lists (PCI bus order), through ``loader()``'s C functions.

    Raises
    ------
    ProbeFailed
        The library is missing, or a call returns an error (its NVML return code named).
    """
    try:
        nvml = loader()
    except OSError as exc:
        raise ProbeFailed(f"NVML: {exc}") from None

    def call(name: str, *args) -> None:
        try:
            rc = getattr(nvml, name)(*args)
        except AttributeError:
            raise ProbeFailed(f"NVML: no {name} in {NVML_LIBRARY}") from None
        if rc != _NVML_SUCCESS:
            raise ProbeFailed(f"NVML: {name} returned {rc}")

    call("nvmlInit_v2")
    count = ctypes.c_uint(0)
    call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    devices = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        name, uuid = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
        call("nvmlDeviceGetName", handle, name, ctypes.c_uint(96))
        call("nvmlDeviceGetUUID", handle, uuid, ctypes.c_uint(96))
        total, reserved = _nvml_memory(nvml, handle, call)
        devices.append(
            PhysicalDevice(
                name.value.decode(errors="replace"),
                uuid.value.decode(errors="replace"),
                total,
                reserved,
                _nvml_mig(nvml, handle),
            )
        )
    return devices


def _nvml_memory(nvml, handle, call) -> tuple[int, int | None]:
    """(total, reserved) bytes: ``nvmlDeviceGetMemoryInfo_v2`` where the driver has it
    (R510+), else the v1 call's total and no reserved share."""
    info2 = _NvmlMemoryV2(version=_NVML_MEMORY_V2)
    fn2 = getattr(nvml, "nvmlDeviceGetMemoryInfo_v2", None)
    if fn2 is not None and fn2(handle, ctypes.byref(info2)) == _NVML_SUCCESS:
        return int(info2.total), int(info2.reserved)
    info = _NvmlMemory()
    call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(info))
    return int(info.total), None


def _nvml_mig(nvml, handle) -> bool:
    """Whether MIG mode is on (``NOT_SUPPORTED``, or a driver without the call: off)."""
    fn = getattr(nvml, "nvmlDeviceGetMigMode", None)
    if fn is None:
        return False
    current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
    rc = fn(handle, ctypes.byref(current), ctypes.byref(pending))
    if rc in (_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_FUNCTION_NOT_FOUND):
        return False
    if rc != _NVML_SUCCESS:
        raise ProbeFailed(f"NVML: nvmlDeviceGetMigMode returned {rc}")
    return current.value == 1


def run_nvidia_smi() -> str:
    """``nvidia-smi --query-gpu=SMI_FIELDS`` as CSV without units (tests replace this).

    Raises ``OSError`` (not installed), ``subprocess.CalledProcessError`` or
    ``subprocess.TimeoutExpired``."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=20,
    )  # fmt: skip
    return out.stdout


def read_nvidia_smi(run: Callable[[], str] = run_nvidia_smi) -> list[PhysicalDevice]:
    """Every GPU ``nvidia-smi`` lists (its ``index`` order; memory in MiB).

    Raises
    ------
    ProbeFailed
        ``nvidia-smi`` is missing, fails or prints a line that is not ``SMI_FIELDS``.
    """
    try:
        text = run()
    except (OSError, subprocess.SubprocessError) as exc:
        raise ProbeFailed(f"nvidia-smi: {exc}") from None
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        try:
            index, uuid, name, total, reserved, mig = cells
            rows.append(
                (int(index), PhysicalDevice(
                    name, uuid, int(total) * _MIB, _mib_or_none(reserved), mig == "Enabled"
                ))
            )  # fmt: skip
        except ValueError:
            raise ProbeFailed(f"nvidia-smi: unexpected line {line!r}") from None
    return [device for _, device in sorted(rows, key=lambda row: row[0])]


def _mib_or_none(cell: str) -> int | None:
    """``memory.reserved`` in bytes; ``[N/A]`` or ``[Not Supported]`` -> ``None``."""
    return int(cell) * _MIB if cell.isdigit() else None


def read_torch() -> tuple[CudaDevice, ...]:
    """The devices as torch sees them (imports torch and initialises the CUDA driver)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(
        CudaDevice(p.name, p.total_memory / 2**30)
        for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
    )


def probe_cuda_devices(
    env: Mapping[str, str] | None = None,
    nvml: Callable[[], list[PhysicalDevice]] = read_nvml,
    smi: Callable[[], list[PhysicalDevice]] = read_nvidia_smi,
    torch_probe: Callable[[], tuple[CudaDevice, ...]] = read_torch,
) -> CudaDevices:
    """The CUDA devices of this process: NVML, else ``nvidia-smi``, else torch (see the
    module's docstring); ``env`` defaults to ``os.environ`` (``CUDA_VISIBLE_DEVICES``,
    ``CUDA_DEVICE_ORDER``).

    Never raises for a missing or failing source: the next one answers, and ``note``
    says why the earlier ones did not."""
    env = os.environ if env is None else env
    start = time.perf_counter()
    notes = []
    for source, read in (("nvml", nvml), ("nvidia-smi", smi)):
        try:
            devices = select_visible(read(), env)
        except DiffersFromCuda as exc:
            notes.append(str(exc))
            break
        except ProbeFailed as exc:
            notes.append(str(exc))
            continue
        return CudaDevices(devices, source, "; ".join(notes), time.perf_counter() - start)
    devices = torch_probe()
    return CudaDevices(devices, "torch", "; ".join(notes), time.perf_counter() - start)


# ----------------------------------------------------------------------------- early context

CUDA_LIBRARY = "libcuda.so.1"


def load_cuda() -> ctypes.CDLL:
    """The CUDA driver library (tests replace this loader). Raises ``OSError`` if absent."""
    return ctypes.CDLL(CUDA_LIBRARY)


def start_cuda_context(
    ordinal: int, marks: dict[str, float], loader: Callable[[], object] = load_cuda
) -> threading.Thread:
    """Initialise the CUDA driver and create device ``ordinal``'s primary context on a
    background thread, while the main thread imports torch.

    torch's first CUDA call (``cuInit``, then the primary context of the device: 0.3 s to
    seconds, more on a GPU without persistence mode) would otherwise run after its import,
    on the path to the first prefill. ``ctypes`` releases the GIL during the driver
    calls, so they overlap the import (which holds the GIL); a thread running Python
    would not (measured: the torch import and the GGUF read in two threads take as long
    as one after the other). The runtime API torch uses works in the same primary context
    (``cuDevicePrimaryCtxRetain``; the reference taken here is kept for the process's
    life, as torch keeps its own), so torch finds the driver initialised and the context
    made. ``CUDA_MODULE_LOADING`` is set to ``LAZY`` unless set, as torch does before its
    own ``cuInit`` (the driver reads it there, once).

    ``ordinal`` counts the devices as CUDA does under this process's
    ``CUDA_VISIBLE_DEVICES`` (``cuda:N``). Only for a process that will use that device
    itself and never forks a child that uses CUDA (the data-parallel and pipeline workers
    are spawned and pick their own devices). On success ``marks["cuda_ready"]`` is the
    ``time.monotonic()`` when the context was made; on any failure (no driver library, a
    driver error) nothing is marked and torch reports the error as before.

    Returns the started (daemon) thread.
    """
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")

    def run() -> None:
        try:
            cuda = loader()
            device, context = ctypes.c_int(0), ctypes.c_void_p()
            if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
                return
            if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0:
                marks["cuda_ready"] = time.monotonic()
        except (OSError, AttributeError):
            return

    thread = threading.Thread(target=run, name="cuda-context", daemon=True)
    thread.start()
    return thread
