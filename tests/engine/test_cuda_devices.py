"""The CUDA devices read without torch (:mod:`engine.cuda_devices`): CUDA_VISIBLE_DEVICES
as torch reads it, a fake NVML library and a fake ``nvidia-smi``, the fallbacks, and
``--preset auto`` choosing what the torch path chooses for the same devices."""

from __future__ import annotations

import ctypes
import subprocess

import pytest

from engine import cuda_devices as cd
from engine.cuda_devices import CudaDevice, PhysicalDevice, ProbeFailed

GIB, MIB = 2**30, 2**20
H200 = PhysicalDevice("NVIDIA H200", "GPU-aaaa-1111", 143771 * MIB, 624 * MIB)
H200_B = PhysicalDevice("NVIDIA H200", "GPU-aaab-2222", 143771 * MIB, 624 * MIB)
RTX = PhysicalDevice("NVIDIA GeForce RTX 4090", "GPU-bbbb-3333", 24564 * MIB, 400 * MIB)


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("0,1", [0, 1]),
        (" 1, 0", [1, 0]),
        ("1gpu,0", [1, 0]),  # read like strtoul
        ("0,-1,1", [0]),  # a negative index ends the list
        ("0,x,1", [0]),  # so does an unreadable one
        ("0,0", []),  # a repeated index hides every device
        ("GPU-aa,GPU-bb", ["GPU-aa", "GPU-bb"]),
        ("GPU-aa,0", ["GPU-aa"]),
        ("GPU-aa,GPU-aa", []),
    ],
)
def test_visible_selection_reads_cuda_visible_devices_as_torch_does(value, expected):
    assert cd.visible_selection(value) == expected


def test_visible_selection_matches_torch_parser(monkeypatch):
    torch_cuda = pytest.importorskip("torch.cuda")
    for value in ("", "-1", "0,1", " 1, 0", "1gpu,0", "0,-1,1", "0,0", "GPU-aa,GPU-bb", "GPU-a,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert cd.visible_selection(value) == torch_cuda._parse_visible_devices(), value


def test_mig_instances_are_left_to_torch():
    with pytest.raises(cd.DiffersFromCuda, match="MIG"):
        cd.visible_selection("MIG-1234")


def names(devices):
    return [d.name for d in devices]


def test_select_visible_indices_uuids_and_limits():
    two = [H200, H200_B]
    assert len(cd.select_visible(two, {})) == 2
    assert cd.select_visible(two, {"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert cd.select_visible(two, {"CUDA_VISIBLE_DEVICES": "-1"}) == ()
    assert len(cd.select_visible(two, {"CUDA_VISIBLE_DEVICES": "1,5,0"})) == 1  # 5 ends it
    by_uuid = cd.select_visible([RTX, H200], {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"})
    assert names(by_uuid) == ["NVIDIA H200", "NVIDIA GeForce RTX 4090"]
    ambiguous = cd.select_visible(two, {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-aaab"})
    assert ambiguous == ()  # GPU-aaa matches both: the list ends before it
    assert by_uuid[0].memory_gib == pytest.approx((143771 - 624) / 1024)


def test_cards_that_differ_are_numbered_by_cuda_unless_pci_order():
    with pytest.raises(cd.DiffersFromCuda, match="CUDA_DEVICE_ORDER"):
        cd.select_visible([RTX, H200], {})
    with pytest.raises(cd.DiffersFromCuda):
        cd.select_visible([RTX, H200], {"CUDA_VISIBLE_DEVICES": "1"})
    ordered = cd.select_visible([RTX, H200], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert names(ordered) == ["NVIDIA GeForce RTX 4090", "NVIDIA H200"]


def test_mig_enabled_is_left_to_torch():
    mig = PhysicalDevice("NVIDIA H200", "GPU-cccc", 143771 * MIB, 624 * MIB, mig=True)
    with pytest.raises(cd.DiffersFromCuda, match="MIG"):
        cd.select_visible([mig], {})


class FakeNvml:
    """The C functions :func:`engine.cuda_devices.read_nvml` calls, writing through the
    ``ctypes.byref`` arguments as libnvidia-ml does."""

    def __init__(self, devices, *, v2=True, fail=None, mig_call=True):
        self.devices, self.fail, self.calls = devices, fail or {}, []
        if not v2:
            self.nvmlDeviceGetMemoryInfo_v2 = None
        if not mig_call:
            self.nvmlDeviceGetMigMode = None

    def __getattribute__(self, name):
        fail = object.__getattribute__(self, "fail")
        if name in fail:
            return lambda *args: fail[name]
        value = object.__getattribute__(self, name)
        if name.startswith("nvml") and value is None:
            raise AttributeError(name)
        return value

    def nvmlInit_v2(self):
        self.calls.append("init")
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.devices)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index.value + 1
        return 0

    def _device(self, handle):
        return self.devices[handle.value - 1]

    def nvmlDeviceGetName(self, handle, buf, size):
        buf.value = self._device(handle).name.encode()
        return 0

    def nvmlDeviceGetUUID(self, handle, buf, size):
        buf.value = self._device(handle).uuid.encode()
        return 0

    def nvmlDeviceGetMemoryInfo_v2(self, handle, info):
        if info._obj.version != 0x02000028:  # nvmlMemory_v2 of nvml.h
            return 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        device = self._device(handle)
        info._obj.total, info._obj.reserved = device.total_bytes, device.reserved_bytes
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, info):
        info._obj.total = self._device(handle).total_bytes
        return 0

    def nvmlDeviceGetMigMode(self, handle, current, pending):
        if not self._device(handle).mig:
            return 3  # NVML_ERROR_NOT_SUPPORTED (a GPU without MIG)
        current._obj.value = 1
        return 0


def test_read_nvml_through_the_c_functions():
    assert ctypes.sizeof(cd._NvmlMemoryV2) == 40  # the size in nvmlMemory_v2's version
    assert cd.read_nvml(lambda: FakeNvml([H200, RTX])) == [H200, RTX]
    mig = PhysicalDevice("NVIDIA H200", "GPU-cccc", 143771 * MIB, 624 * MIB, mig=True)
    assert cd.read_nvml(lambda: FakeNvml([mig])) == [mig]


def test_read_nvml_without_the_v2_memory_call_reads_the_total():
    (device,) = cd.read_nvml(lambda: FakeNvml([H200], v2=False, mig_call=False))
    assert device.total_bytes == H200.total_bytes and device.reserved_bytes is None
    assert device.cuda_total_bytes == H200.total_bytes


def test_read_nvml_failures_name_the_call():
    def missing():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    with pytest.raises(ProbeFailed, match="cannot open"):
        cd.read_nvml(missing)
    with pytest.raises(ProbeFailed, match="nvmlInit_v2 returned 9"):
        cd.read_nvml(lambda: FakeNvml([H200], fail={"nvmlInit_v2": 9}))
    with pytest.raises(ProbeFailed, match="nvmlDeviceGetName returned 1"):
        cd.read_nvml(lambda: FakeNvml([H200], fail={"nvmlDeviceGetName": 1}))


SMI = """\
1, GPU-aaab-2222, NVIDIA H200, 143771, 624, [N/A]
0, GPU-aaaa-1111, NVIDIA H200, 143771, 624, [N/A]
"""


def test_read_nvidia_smi_sorts_by_index_and_reads_mib():
    assert cd.read_nvidia_smi(lambda: SMI) == [H200, H200_B]
    (old,) = cd.read_nvidia_smi(lambda: "0, GPU-x, Tesla T4, 15360, [N/A], Disabled\n")
    assert old.reserved_bytes is None and old.total_bytes == 15360 * MIB and not old.mig
    (mig,) = cd.read_nvidia_smi(lambda: "0, GPU-x, NVIDIA H200, 143771, 624, Enabled\n")
    assert mig.mig


def test_read_nvidia_smi_failures():
    def absent():
        raise FileNotFoundError("nvidia-smi")

    def failing():
        raise subprocess.CalledProcessError(9, ["nvidia-smi"])

    for run in (absent, failing, lambda: "No devices were found, or so\n"):
        with pytest.raises(ProbeFailed, match="nvidia-smi"):
            cd.read_nvidia_smi(run)


def failing_source(message):
    def read():
        raise ProbeFailed(message)

    return read


def no_torch():
    raise AssertionError("torch probed")


def test_probe_falls_back_nvml_then_smi_then_torch():
    nvml = lambda: [H200]  # noqa: E731
    smi = lambda: [H200, H200_B]  # noqa: E731
    torch_view = (CudaDevice("NVIDIA H200", 139.8),)
    got = cd.probe_cuda_devices({}, nvml, smi, no_torch)
    assert (got.source, len(got.devices), got.note) == ("nvml", 1, "")
    got = cd.probe_cuda_devices({}, failing_source("NVML: x"), smi, no_torch)
    assert (got.source, len(got.devices), got.note) == ("nvidia-smi", 2, "NVML: x")
    got = cd.probe_cuda_devices(
        {}, failing_source("NVML: x"), failing_source("nvidia-smi: y"), lambda: torch_view
    )
    assert (got.source, got.devices, got.note) == ("torch", torch_view, "NVML: x; nvidia-smi: y")
    assert "read through torch" in got.describe() and "NVML: x" in got.describe()


def test_probe_goes_straight_to_torch_when_nvml_could_differ_from_cuda():
    torch_view = (CudaDevice("NVIDIA H200", 139.8), CudaDevice("NVIDIA GeForce RTX 4090", 23.6))
    got = cd.probe_cuda_devices({}, lambda: [RTX, H200], no_torch_smi, lambda: torch_view)
    assert got.source == "torch" and got.devices == torch_view and "fastest" in got.note


def no_torch_smi():
    raise AssertionError("nvidia-smi asked after NVML said it could differ from CUDA")


def cuda_view(physical, env):
    """What CUDA (and so torch) would list, computed here independently: the visible
    indices in PCI order (the cards are identical or ordered by PCI bus), memory as
    CUDA's total."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        chosen = list(physical)
    elif value.startswith("GPU-"):
        chosen = [next(d for d in physical if d.uuid.startswith(u)) for u in value.split(",")]
    else:
        chosen = []
        for part in value.split(","):
            if not part.strip().isdigit() or int(part) >= len(physical):
                break
            chosen.append(physical[int(part)])
    return [(d.total_bytes - d.reserved_bytes) / GIB for d in chosen]


MACHINES = [
    ([H200], {}),
    ([H200, H200_B], {}),
    ([H200, H200_B], {"CUDA_VISIBLE_DEVICES": "1"}),
    ([H200, H200_B], {"CUDA_VISIBLE_DEVICES": ""}),
    ([H200, H200_B], {"CUDA_VISIBLE_DEVICES": "-1"}),
    ([H200, H200_B], {"CUDA_VISIBLE_DEVICES": "GPU-aaab"}),
    ([H200, H200_B], {"CUDA_VISIBLE_DEVICES": "0,7"}),
    ([RTX, RTX, RTX], {}),
    ([RTX, RTX, RTX], {"CUDA_VISIBLE_DEVICES": "2"}),
    ([RTX, H200], {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,0"}),
    ([], {}),
]


@pytest.mark.parametrize("flags", [(), ("cuda:1",), ("cpu",), ("cuda:0", "cuda:1")])
@pytest.mark.parametrize("physical, env", MACHINES)
def test_auto_preset_through_nvml_equals_the_torch_path(monkeypatch, physical, env, flags):
    from hisparse_cli import runner

    monkeypatch.setattr(runner, "no_gpu_driver", lambda: False)
    probed = cd.probe_cuda_devices(env, lambda: list(physical), no_torch_smi, no_torch)
    assert probed.source == "nvml"
    monkeypatch.setattr(runner, "cuda_devices", _cached(probed))
    through_nvml = runner.auto_preset(flags)
    memories = cuda_view(physical, env)
    monkeypatch.setattr(runner, "cuda_devices", _cached(None))  # the torch path: the hooks
    monkeypatch.setattr(runner, "cuda_device_count", lambda: len(memories))
    monkeypatch.setattr(runner, "cuda_device_memory_gib", lambda i: memories[i])
    through_torch = runner.auto_preset(flags)
    assert (through_nvml.name, through_nvml.reason) == (through_torch.name, through_torch.reason)
    assert through_nvml.read_by.startswith("read through NVML")


def _cached(value):
    """A stand-in for the cached :func:`hisparse_cli.runner.cuda_devices` (``None``: not
    probed in this process)."""

    def probe():
        assert value is not None, "probed"
        return value

    probe.cache_info = lambda: type("Info", (), {"currsize": int(value is not None)})()
    return probe


@pytest.mark.cuda
def test_nvml_agrees_with_torch_on_this_machine():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hisparse_cli.auto_preset import choose_preset

    probed = cd.probe_cuda_devices()
    seen = cd.read_torch()
    assert probed.source in ("nvml", "nvidia-smi"), probed.describe()
    assert names(probed.devices) == names(seen)
    for mine, theirs in zip(probed.devices, seen, strict=True):
        assert abs(mine.memory_gib - theirs.memory_gib) < 0.05, (mine, theirs)
    as_probed = choose_preset([d.memory_gib for d in probed.devices])
    assert as_probed == choose_preset([d.memory_gib for d in seen])


class FakeCuda:
    """``cuInit``, ``cuDeviceGet`` and ``cuDevicePrimaryCtxRetain`` of libcuda."""

    def __init__(self, fail=""):
        self.fail, self.calls = fail, []

    def cuInit(self, flags):  # noqa: N802
        self.calls.append(("cuInit", flags))
        return 3 if self.fail == "cuInit" else 0  # CUDA_ERROR_NOT_INITIALIZED

    def cuDeviceGet(self, device, ordinal):  # noqa: N802
        self.calls.append(("cuDeviceGet", ordinal))
        device._obj.value = ordinal
        return 101 if self.fail == "cuDeviceGet" else 0  # CUDA_ERROR_INVALID_DEVICE

    def cuDevicePrimaryCtxRetain(self, context, device):  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value))
        context._obj.value = 0xC0
        return 0


def test_start_cuda_context_makes_the_primary_context_of_the_device(monkeypatch):
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    fake, marks = FakeCuda(), {}
    cd.start_cuda_context(1, marks, lambda: fake).join()
    assert fake.calls == [("cuInit", 0), ("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 1)]
    assert "cuda_ready" in marks
    assert cd.os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # as torch sets it before cuInit


def test_start_cuda_context_failures_mark_nothing(monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # the user's choice is kept
    for fail in ("cuInit", "cuDeviceGet"):
        fake, marks = FakeCuda(fail), {}
        cd.start_cuda_context(0, marks, lambda fake=fake: fake).join()
        assert marks == {} and ("cuDevicePrimaryCtxRetain", 0) not in fake.calls

    def absent():
        raise OSError("libcuda.so.1: cannot open shared object file")

    marks = {}
    cd.start_cuda_context(0, marks, absent).join()
    assert marks == {} and cd.os.environ["CUDA_MODULE_LOADING"] == "EAGER"


@pytest.mark.parametrize(
    "device, devices, ordinal",
    [("cuda", (), 0), ("cuda:1", (), 1), ("cpu", ("cuda:2",), 2), ("cpu", (), None),
     ("cuda:0", ("cuda:0", "cuda:1"), None)],
)  # fmt: skip
def test_warm_cuda_only_for_one_cuda_device(monkeypatch, device, devices, ordinal):
    from engine.config import EngineConfig
    from hisparse_cli import runner

    started = []
    monkeypatch.setattr(cd, "start_cuda_context", lambda n, marks: started.append(n))
    runner.warm_cuda(EngineConfig(device=device, devices=devices), {})
    assert started == ([] if ordinal is None else [ordinal])
