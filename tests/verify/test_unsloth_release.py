"""`verify.unsloth_release`: the loader of Unsloth 2026.10.9's NF4 kernel files, run as a peer (AGPL-3.0).

Three groups:
- no release needed (always run, CI too): the error for a missing folder, hash checks on a release
  and a wheel built in tmp_path (the pinned override file among them), the `unsloth_zoo.utils.Version`
  stand-in and when it is used;
- the extracted release needed: loading, provenance, a modified copy refused, and on a CPU the
  release's own Triton kernel in Triton's interpreter against bitsandbytes' CPU dequantize_4bit,
  bit for bit; the release's bnb_override.py on our stand-in utils (delegation, its default rule,
  a forced install and uninstall, and on a CPU a forced install leaving Linear4bit's output and
  input gradient bit-identical). These skip when `<repo>/.peers/unsloth-2026.10.9` (or
  $NF4_UNSLOTH_DIR) is absent, as in CI, which never fetches Unsloth. To run them, fetch it first:
      python3 -m pip download --no-deps -d /tmp/peers unsloth==2026.10.9
      python -m verify.unsloth_release extract /tmp/peers/unsloth-2026.10.9-py3-none-any.whl
- GPU (`gpu` marker, skipped without CUDA): fast_dequantize on CUDA, each path (allocate, `out=`,
  use_global_buffer with its kept launch), against bitsandbytes' CUDA dequantize_4bit, and fast_gemv;
  the forced override on a CUDA Linear4bit against bitsandbytes' own forward and backward.

In the interpreter the release's `dequantize_nf4` asks torch.cuda for the current device and the
compute capability (for its launch configuration); the CPU tests answer those two questions with
monkeypatch (`current_device` -> None, the release's own `_CONFIG_OVERRIDE` test hook), so its
function and kernel run unchanged. The interpreter converts float32 to bfloat16 by truncation, not
to nearest even, so bf16 outputs are checked on the GPU; on a CPU a test shows that the truncation
is the only difference.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from verify import unsloth_release as ur
from verify.exact import assert_bitexact

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Launch configurations of the release's `_CONFIG_OVERRIDE` hook: (target bytes per program, num_warps,
# int32 words, evict_first, LUT mode), together reaching every branch of its kernel.
CONFIGS = {"bytes-lut0": (256, 2, False, False, 0), "words-lut1": (256, 2, True, True, 1),
           "words-lut2": (512, 4, True, False, 2), "bytes-lut2": (64, 1, False, False, 2)}
SHAPES = [(33, 70), (7, 194), (1, 130), (5, 256)]
INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


# --- helpers --------------------------------------------------------------------------------


def _urlsafe(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_wheel(path, files: dict[str, bytes], record_override: dict[str, bytes] | None = None):
    """A wheel (zip) holding `files` and a RECORD; record_override gives other bytes to hash in RECORD."""
    record = {**files, **(record_override or {})}
    lines = [f"{name},sha256={_urlsafe(data)},{len(data)}" for name, data in record.items()]
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("fake-0.dist-info/RECORD", "\n".join([*lines, "fake-0.dist-info/RECORD,,"]) + "\n")
    return path


FAKE = {"unsloth/kernels/a.py": b"A = 1\n", "unsloth/kernels/b.py": b"B = 2\n"}
FAKE_EXPECTED = {name: hashlib.sha256(data).hexdigest() for name, data in FAKE.items()}
# The release's layout (every pinned path, the override last) with bytes of our own.
FAKE_PINNED = {rel: f"# not Unsloth's file: a stand-in for {rel}\n".encode() for rel in ur.FILES}
FAKE_PINNED_EXPECTED = {name: hashlib.sha256(data).hexdigest() for name, data in FAKE_PINNED.items()}


def _fake_release(tmp_path):
    wheel = _fake_wheel(tmp_path / "fake.whl", FAKE)
    return ur.extract(wheel, tmp_path / "release", expected=FAKE_EXPECTED, wheel_sha256=None, licenses=())


def _flip_byte(path, index=10):
    data = bytearray(path.read_bytes())
    data[index] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def release():
    """The loaded release; skips (not fails) when it was never fetched, as in CI."""
    try:
        ur.verify_release()
    except FileNotFoundError as error:
        pytest.skip(f"Unsloth {ur.VERSION} not extracted: {str(error).splitlines()[0]}")
    return ur.load()


def _quantize(shape, dtype, blocksize, double_quant, seed, device="cpu"):
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 4, shape, generator=g).float())
    x.view(-1)[::11] = 0.0
    return F.quantize_4bit(x.to(dtype).to(device), blocksize=blocksize, compress_statistics=double_quant,
                           quant_type="nf4")


def _bnb(packed, state):
    import bitsandbytes.functional as F

    return F.dequantize_4bit(packed, state, quant_type="nf4")


def _assert_same(got, expect, name="output"):
    assert got.dtype == expect.dtype and tuple(got.shape) == tuple(expect.shape), (got.dtype, got.shape, expect.shape)
    view = INT_VIEW[got.dtype]
    assert torch.equal(got.contiguous().view(view), expect.contiguous().view(view)), name
    assert_bitexact(got, expect, name=name)  # the same check, with a report of the first differences


@pytest.fixture
def interpreter(release, monkeypatch):
    """The CPU stand-ins for the release's two CUDA queries (see the module docstring)."""
    if not INTERPRETING:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without CUDA)")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)

    def configure(config):
        monkeypatch.setattr(release.nf4, "_CONFIG_OVERRIDE", config)

    return configure


@pytest.fixture
def override(release):
    """The release's override, not installed; afterwards uninstalled and bitsandbytes' Linear4bit.forward
    and the module's `_LINEAR` put back exactly as they were, whatever the test did."""
    import bitsandbytes as bnb

    loaded = release.bnb_override()
    original, linear = bnb.nn.Linear4bit.forward, loaded.module._LINEAR
    assert not loaded.installed(), "the override was left installed by an earlier test"
    try:
        yield loaded
    finally:
        try:
            loaded.uninstall()
        finally:
            bnb.nn.Linear4bit.forward = original
            loaded.module._LINEAR = linear


def _linear4bit(in_features, out_features, seed, device):
    """A bf16 NF4 Linear4bit (double quantization, blocksize 64) from a seeded bf16 weight, quantized on
    `device` by `.to(device)` as tests/nf4/integrations/test_bitsandbytes.py does it. Its bias is bf16
    and frozen, as a QLoRA base layer's (the release leaves a layer whose bias needs a gradient to
    bitsandbytes). train(): bitsandbytes' CPU forward then keeps the weight's layout."""
    import bitsandbytes as bnb

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(out_features, generator=g) * 0.1).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=True, compute_dtype=torch.bfloat16,
                              compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                     quant_storage=torch.uint8, blocksize=64)
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer = layer.to(device).train()
    state = layer.weight.quant_state
    assert layer.weight.bnb_quantized and state.quant_type == "nf4" and state.dtype is torch.bfloat16
    assert state.nested and state.state2.blocksize == 256 and layer.weight.device.type == torch.device(device).type
    return layer


def _counted(calls, name, function):
    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return function(*args, **kwargs)

    return counted


# --- without the release --------------------------------------------------------------------------


def test_missing_folder_says_how_to_fetch(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    for call in (lambda: ur.load(missing), lambda: ur.provenance(missing)):
        with pytest.raises(FileNotFoundError) as info:
            call()
        message = str(info.value)
        assert str(missing) in message
        assert ur.PIP_DOWNLOAD in message and "pip download --no-deps" in message
        assert ur.EXTRACT in message
        assert "unsloth/kernels/{triton_launch,nf4,nf4_gemv,bnb_override}.py" in message
    monkeypatch.setenv(ur.ENV, str(missing))
    assert ur.release_root() == missing.resolve()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ur.load()
    (missing).mkdir()
    with pytest.raises(FileNotFoundError, match=ur.MANIFEST):
        ur.load()


def test_default_root_is_in_the_ignored_peers_folder(monkeypatch):
    monkeypatch.delenv(ur.ENV, raising=False)
    assert ur.release_root() == ur.REPO / ".peers" / "unsloth-2026.10.9"
    assert ur.release_root("elsewhere") == (ur.Path.cwd() / "elsewhere").resolve()


def test_extract_writes_files_and_manifest(tmp_path):
    root = _fake_release(tmp_path)
    manifest = json.loads((root / ur.MANIFEST).read_text())
    assert manifest["version"] == ur.VERSION and manifest["wheel"] == "fake.whl"
    assert manifest["wheel_sha256"] == hashlib.sha256((tmp_path / "fake.whl").read_bytes()).hexdigest()
    assert manifest["files"] == FAKE_EXPECTED
    for name, data in FAKE.items():
        assert (root / name).read_bytes() == data  # the wheel's layout
    assert ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None) == manifest


def test_extract_refuses_a_bad_wheel(tmp_path):
    good = _fake_wheel(tmp_path / "good.whl", FAKE)
    with pytest.raises(ur.IntegrityError, match="pinned"):  # not the pinned unsloth wheel
        ur.extract(good, tmp_path / "r1", expected=FAKE_EXPECTED, licenses=())
    bad_record = _fake_wheel(tmp_path / "bad.whl", FAKE, record_override={"unsloth/kernels/a.py": b"other\n"})
    with pytest.raises(ur.IntegrityError, match="RECORD"):
        ur.extract(bad_record, tmp_path / "r2", expected=FAKE_EXPECTED, wheel_sha256=None, licenses=())
    other = {**FAKE_EXPECTED, "unsloth/kernels/b.py": "0" * 64}
    with pytest.raises(ur.IntegrityError, match="pinned"):
        ur.extract(good, tmp_path / "r3", expected=other, wheel_sha256=None, licenses=())


def test_hash_check_rejects_a_modified_file(tmp_path):
    root = _fake_release(tmp_path)
    _flip_byte(root / "unsloth/kernels/b.py", 2)
    with pytest.raises(ur.IntegrityError, match=r"b\.py"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_hash_check_rejects_a_manifest_edited_to_match(tmp_path):
    root = _fake_release(tmp_path)
    target = root / "unsloth/kernels/a.py"
    _flip_byte(target, 0)
    manifest = json.loads((root / ur.MANIFEST).read_text())
    manifest["files"]["unsloth/kernels/a.py"] = hashlib.sha256(target.read_bytes()).hexdigest()
    (root / ur.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ur.IntegrityError, match="pinned"):  # the pinned hashes still disagree
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_hash_check_rejects_wrong_version_wheel_and_file_list(tmp_path):
    root = _fake_release(tmp_path)
    path = root / ur.MANIFEST
    good = json.loads(path.read_text())
    for change, match in (({"version": "2026.1.1"}, "version"), ({"wheel_sha256": "0" * 64}, "wheel_sha256"),
                          ({"files": {**good["files"], "x.py": "0" * 64}}, "files")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ur.IntegrityError, match=match):
            ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=good["wheel_sha256"])
    path.write_text("{not json")
    with pytest.raises(ur.IntegrityError, match="JSON"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)
    path.write_text(json.dumps(good))
    (root / "unsloth/kernels/a.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"a\.py"):
        ur.verify_release(root, expected=FAKE_EXPECTED, wheel_sha256=None)


def test_extract_copies_the_override_file(tmp_path):
    """The override is pinned with the kernels: extracted, listed in the manifest (after them), checked;
    `load()` imports the kernel files only."""
    assert list(ur.FILES) == [*ur.KERNEL_FILES, ur.OVERRIDE_FILE]
    assert list(ur.KERNEL_FILES) == ["unsloth/kernels/triton_launch.py", "unsloth/kernels/nf4.py",
                                     "unsloth/kernels/nf4_gemv.py"]
    assert ur.FILES[ur.OVERRIDE_FILE] == ur.OVERRIDE_SHA256
    wheel = _fake_wheel(tmp_path / "fake.whl", {**FAKE_PINNED, "unsloth/kernels/utils.py": b"U = 0\n"})
    root = ur.extract(wheel, tmp_path / "release", expected=FAKE_PINNED_EXPECTED, wheel_sha256=None, licenses=())
    manifest = json.loads((root / ur.MANIFEST).read_text())
    assert list(manifest["files"]) == list(ur.FILES) and manifest["files"] == FAKE_PINNED_EXPECTED
    assert (root / ur.OVERRIDE_FILE).read_bytes() == FAKE_PINNED[ur.OVERRIDE_FILE]
    assert not (root / "unsloth/kernels/utils.py").exists()  # only pinned files are copied
    assert ur.verify_release(root, expected=FAKE_PINNED_EXPECTED, wheel_sha256=None) == manifest

    # A folder extracted before the override was pinned: refused, with the command that fixes it.
    old = {**manifest, "files": {rel: sha for rel, sha in manifest["files"].items() if rel != ur.OVERRIDE_FILE}}
    (root / ur.MANIFEST).write_text(json.dumps(old))
    with pytest.raises(ur.IntegrityError, match="extract them again"):
        ur.verify_release(root, expected=FAKE_PINNED_EXPECTED, wheel_sha256=None)

    # The real pin of the override is enforced on extraction.
    pinned = {**{rel: FAKE_PINNED_EXPECTED[rel] for rel in ur.KERNEL_FILES}, ur.OVERRIDE_FILE: ur.OVERRIDE_SHA256}
    with pytest.raises(ur.IntegrityError, match=r"bnb_override\.py.*pinned"):
        ur.extract(wheel, tmp_path / "r2", expected=pinned, wheel_sha256=None, licenses=())


def test_tampered_override_is_refused(tmp_path):
    wheel = _fake_wheel(tmp_path / "fake.whl", FAKE_PINNED)
    root = ur.extract(wheel, tmp_path / "release", expected=FAKE_PINNED_EXPECTED, wheel_sha256=None, licenses=())
    target = root / ur.OVERRIDE_FILE
    _flip_byte(target, 5)
    with pytest.raises(ur.IntegrityError, match=r"bnb_override\.py"):
        ur.verify_release(root, expected=FAKE_PINNED_EXPECTED, wheel_sha256=None)
    manifest = json.loads((root / ur.MANIFEST).read_text())
    manifest["files"][ur.OVERRIDE_FILE] = hashlib.sha256(target.read_bytes()).hexdigest()
    (root / ur.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ur.IntegrityError, match=r"bnb_override\.py.*pinned"):  # the manifest edited to match
        ur.verify_release(root, expected=FAKE_PINNED_EXPECTED, wheel_sha256=None)
    target.unlink()
    with pytest.raises(FileNotFoundError, match=r"bnb_override\.py"):
        ur.verify_release(root, expected=FAKE_PINNED_EXPECTED, wheel_sha256=None)


def test_shim_version_compares_like_unsloth_zoo():
    V = ur.ShimVersion
    assert V("3.7.0") >= V("3.7.0") and V("3.7") == V("3.7.0") and V("3.6.0") < V("3.7.0")
    assert V("3.10.1") > V("3.9.0")  # numerically, not as text
    assert V("3.7.0+git4f2c") > V("3.7.0") and V("3.7.0.dev20260101") > V("3.7.0")  # a suffix is one step above
    assert V("3.7.0rc1") < V("3.7.1")
    assert V(V("3.6.0")) == "3.6.0"
    with pytest.raises(ValueError):
        V("no digits")


def test_shim_only_when_unsloth_zoo_is_missing(monkeypatch):
    real_zoo = importlib.util.find_spec("unsloth_zoo") is not None
    monkeypatch.delitem(sys.modules, "unsloth_zoo.utils", raising=False)
    assert ur.version_shim_needed() is (not real_zoo)
    before = {name: sys.modules.get(name) for name in ("unsloth_zoo", "unsloth_zoo.utils")}
    with ur._version_provider() as shim:
        assert shim is (not real_zoo)
        if shim:
            from unsloth_zoo.utils import Version

            assert Version is ur.ShimVersion
    assert {name: sys.modules.get(name) for name in before} == before  # the stand-in is gone again

    # An unsloth_zoo.utils already imported (the real one, say) is used as it is, untouched.
    zoo_utils = types.ModuleType("unsloth_zoo.utils")
    zoo_utils.Version = object()
    monkeypatch.setitem(sys.modules, "unsloth_zoo.utils", zoo_utils)
    assert not ur.version_shim_needed()
    with ur._version_provider() as shim:
        assert shim is False
        assert sys.modules["unsloth_zoo.utils"] is zoo_utils
    assert sys.modules["unsloth_zoo.utils"] is zoo_utils


# --- with the extracted release ----------------------------------------------------------------------


def test_load_and_provenance(release):
    assert release.version == "2026.10.9"
    assert release.wheel == ur.WHEEL
    assert release.wheel_sha256 == ur.WHEEL_SHA256
    assert release.files == ur.FILES
    prov = release.provenance()
    assert prov == ur.provenance() == {"peer": "unsloth", "version": "2026.10.9",
                                       "wheel_sha256": ur.WHEEL_SHA256, "files": ur.FILES}
    assert set(prov["files"]) == {"unsloth/kernels/nf4.py", "unsloth/kernels/nf4_gemv.py",
                                  "unsloth/kernels/triton_launch.py", "unsloth/kernels/bnb_override.py"}
    assert set(release.modules) == {"nf4", "nf4_gemv", "triton_launch"}  # load() imports the kernels only
    assert ur.load() is release  # once per process
    assert release.shim is (importlib.util.find_spec("unsloth_zoo") is None)


def test_loaded_as_a_private_package_without_unsloth(release):
    assert "unsloth" not in sys.modules  # the full package is never imported
    for stem in ("nf4", "nf4_gemv", "triton_launch"):
        module = sys.modules[f"{ur.PACKAGE}.kernels.{stem}"]
        assert module is release.modules[stem]
        assert module.__file__ == str(release.root / "unsloth" / "kernels" / f"{stem}.py")
    assert release.dequantize_nf4 is release.nf4.dequantize_nf4
    assert release.gemv_nf4 is release.nf4_gemv.gemv_nf4
    assert release.nf4.Version is (ur.ShimVersion if release.shim else sys.modules["unsloth_zoo.utils"].Version)
    if release.shim:
        assert "unsloth_zoo" not in sys.modules and "unsloth_zoo.utils" not in sys.modules
    assert not (release.root / "unsloth" / "kernels" / "__pycache__").exists()  # no bytecode written there


@pytest.mark.parametrize("rel", ["unsloth/kernels/nf4.py", ur.OVERRIDE_FILE], ids=lambda rel: Path(rel).name)
def test_modified_copy_is_refused(release, tmp_path, rel):
    copy_root = tmp_path / "unsloth-copy"
    shutil.copytree(release.root, copy_root)
    assert ur.provenance(copy_root) == release.provenance()
    _flip_byte(copy_root / rel, 500)
    name = re.escape(Path(rel).name)
    with pytest.raises(ur.IntegrityError, match=name):
        ur.verify_release(copy_root)
    with pytest.raises(ur.IntegrityError, match=name):
        ur.load(copy_root)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "flat"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreter_exact_with_bnb_cpu(release, interpreter, dtype, double_quant, config):
    """The release's dequantize_nf4 (through fast_dequantize) in the interpreter, bit for bit."""
    interpreter(CONFIGS[config])
    for i, shape in enumerate(SHAPES):
        for blocksize in (64, 128, 256):
            packed, state = _quantize(shape, dtype, blocksize, double_quant, seed=1000 * i + blocksize)
            expect = _bnb(packed, state)
            _assert_same(release.fast_dequantize(packed, state), expect, f"{shape} bs{blocksize}")
            out = torch.empty(state.shape, dtype=dtype)
            got = release.fast_dequantize(packed, state, out=out)
            assert got.data_ptr() == out.data_ptr()
            _assert_same(got, expect, f"{shape} bs{blocksize} out=")


def test_interpreter_bf16_is_truncated_fp32(release, interpreter):
    """bf16 in the interpreter: the kernel's float32 values are bitsandbytes' own, and its bf16 output is
    their truncation (the interpreter's conversion), where bitsandbytes rounds them to nearest even."""
    interpreter(CONFIGS["bytes-lut0"])
    packed, state = _quantize((33, 70), torch.bfloat16, 64, True, seed=7)
    state32 = copy.copy(state)
    state32.dtype = torch.float32
    values = release.fast_dequantize(packed, state32)
    _assert_same(values, _bnb(packed, state32), "fp32 values")
    got = release.fast_dequantize(packed, state)
    assert torch.equal(got.view(torch.int16), (values.view(torch.int32) >> 16).to(torch.int16))
    _assert_same(values.to(torch.bfloat16), _bnb(packed, state), "fp32 values rounded to bf16")


def test_interpreter_refuses_what_unsloth_refuses(release, interpreter):
    interpreter(CONFIGS["bytes-lut0"])
    packed, state = _quantize((4, 64), torch.float16, 64, True, seed=3)
    wrong = torch.empty(4, 64, dtype=torch.float32)
    with pytest.raises(AssertionError):  # utils.py asserts the shape and dtype of `out` first
        release.fast_dequantize(packed, state, out=wrong)
    args = ur._unpack(state)
    absmax, shape, dtype, blocksize, code, code2, absmax2, offset, blocksize2 = args
    with pytest.raises(ValueError, match="wrong dtype or size"):  # and dequantize_nf4 checks them too
        release.dequantize_nf4(packed, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype,
                               out=wrong)
    with pytest.raises(ValueError, match="power-of-two"):
        release.dequantize_nf4(packed, absmax, code2, absmax2, offset, code, 96, blocksize2, shape, dtype)
    assert release.fast_dequantize(packed, None) is packed
    fp4 = copy.copy(state)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="not NF4"):
        release.fast_dequantize(packed, fp4)


# --- the release's bnb_override.py ---------------------------------------------------------------------


def test_bnb_override_loads_once_on_our_utils(release):
    import bitsandbytes as bnb

    forward = bnb.nn.Linear4bit.forward
    loaded = release.bnb_override()
    assert release.bnb_override() is loaded  # once per Release
    module = loaded.module
    assert module is sys.modules[f"{ur.PACKAGE}.kernels.bnb_override"] is release.kernels_package.bnb_override
    assert module.__file__ == str(release.root / "unsloth" / "kernels" / "bnb_override.py")
    assert callable(module.install_bnb_nf4_override) and callable(module.uninstall_bnb_nf4_override)
    assert module._U is sys.modules[f"{ur.PACKAGE}.kernels.utils"] is release.kernels_package.utils
    assert bnb.nn.Linear4bit.forward is forward  # importing it installs nothing
    assert "unsloth" not in sys.modules
    if release.shim:  # its `from unsloth_zoo.utils import Version` saw our stand-in, gone again afterwards
        assert module.Version is ur.ShimVersion
        assert "unsloth_zoo" not in sys.modules and "unsloth_zoo.utils" not in sys.modules
    # its Version(torch.__version__) >= Version("2.11.0") ran (the except branch would leave False)
    torch_version = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert module._TRACE is (torch_version >= (2, 11) and hasattr(torch.library, "triton_op"))
    prov = loaded.provenance()
    assert prov == {**release.provenance(), "override": ur.OVERRIDE_FILE}
    assert prov["files"][ur.OVERRIDE_FILE] == ur.OVERRIDE_SHA256 == loaded.sha256


def test_standin_utils_delegates(release, monkeypatch):
    """The stand-in `utils` offers the three names and hands every call to the Release (looked up at
    call time); `dtype` is not passed on."""
    U = release.bnb_override().module._U
    assert {name for name in vars(U) if not name.startswith("__")} == {"fast_dequantize", "fast_gemv",
                                                                       "_USE_NF4_KERNELS"}
    assert U._USE_NF4_KERNELS is True
    assert "nf4-triton's stand-in" in U.__doc__ and "unsloth/kernels/utils.py" in U.__doc__
    calls, result = [], object()

    def recorder(name):
        def record(*args, **kwargs):
            calls.append((name, [id(a) for a in args], {k: id(v) for k, v in kwargs.items()}))
            return result

        return record

    monkeypatch.setattr(release, "fast_dequantize", recorder("dq"))
    monkeypatch.setattr(release, "fast_gemv", recorder("gemv"))
    g = torch.Generator().manual_seed(11)
    W = torch.randint(0, 256, (64, 1), generator=g, dtype=torch.uint8)
    X = torch.randn(1, 1, 128, generator=g)
    out = torch.empty(2, 64)
    state = object()
    assert U.fast_dequantize(W, state, dtype=torch.float16) is result
    assert U.fast_dequantize(W, state, out, True, torch.float32) is result  # the release's positional order
    assert U.fast_gemv(X, W, state) is result
    assert U.fast_gemv(X, W, state, out=out) is result
    assert calls == [("dq", [id(W), id(state)], {"out": id(None), "use_global_buffer": id(False)}),
                     ("dq", [id(W), id(state)], {"out": id(out), "use_global_buffer": id(True)}),
                     ("gemv", [id(X), id(W), id(state)], {"out": id(None)}),
                     ("gemv", [id(X), id(W), id(state)], {"out": id(out)})]


def test_standin_dequantize_ignores_dtype(release, interpreter):
    """Through the stand-in, the release's own kernel (interpreter) dequantizes an fp16 state to fp16 bit
    for bit with bitsandbytes, whatever `dtype` the override passes."""
    interpreter(CONFIGS["bytes-lut0"])
    U = release.bnb_override().module._U
    packed, state = _quantize((33, 128), torch.float16, 64, True, seed=13)
    expect = _bnb(packed, state)
    for dtype in (None, torch.float16, torch.bfloat16, torch.float32):
        _assert_same(U.fast_dequantize(packed, state, dtype=dtype), expect, f"dtype={dtype}")
    assert U.fast_dequantize(packed, None, dtype=torch.float16) is packed


def test_default_on_is_the_releases_rule(override, monkeypatch):
    module = override.module
    assert module._default_on([(9, 0)], True, False) is False  # H100 with bitsandbytes' fused GEMM: off
    assert module._default_on([(10, 0)], True, False) is True  # B200: on
    assert module._default_on([(12, 0), (10, 0)], True, False) is True
    assert module._default_on([(10, 0), (9, 0)], True, False) is False  # every GPU must qualify
    assert module._default_on([(9, 0)], False, False) is True  # bitsandbytes before 0.50: on from sm75
    assert module._default_on([(10, 0)], True, True) is False  # ROCm: off
    seen = []

    def recorded(capabilities, has_fused_gemm, hip):
        seen.append((capabilities, has_fused_gemm, hip))
        return "answer"

    monkeypatch.setattr(module, "_default_on", recorded)
    assert override.default_on() is True  # the release's answer, as a bool
    capabilities = ([tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
                    if torch.cuda.is_available() else [])
    assert seen == [(capabilities, hasattr(torch.ops.bitsandbytes, "gemm_4bit"), torch.version.hip is not None)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only answers")
def test_default_off_on_cpu(override):
    import bitsandbytes as bnb

    assert override.default_on() is False
    if override.module._LINEAR != "auto":
        pytest.skip("UNSLOTH_BNB_NF4_LINEAR was set when the release's override was imported")
    forward = bnb.nn.Linear4bit.forward
    assert override.install() is False  # not forced: the release declines on this machine
    assert bnb.nn.Linear4bit.forward is forward and not override.installed() and not override.forced


def test_forced_install_and_uninstall(override):
    import bitsandbytes as bnb

    module = override.module
    original, linear = bnb.nn.Linear4bit.forward, module._LINEAR
    if not module._ENABLED:
        pytest.skip("UNSLOTH_BNB_TRITON=0 was set when the release's override was imported")
    assert override.install(force=True) is True
    assert bnb.nn.Linear4bit.forward is module._nf4_forward and override.installed()
    assert module._LINEAR == "1" and override.forced
    assert module._FALLBACK["forward"] is original
    assert override.install(force=True) is True  # idempotent: the forward it falls back to stays bitsandbytes'
    assert module._FALLBACK["forward"] is original
    override.uninstall()
    assert bnb.nn.Linear4bit.forward is original  # the very same function object
    assert module._LINEAR == linear and not override.installed() and not override.forced

    with override.installed_override(force=True) as installed:
        assert installed is True and bnb.nn.Linear4bit.forward is module._nf4_forward
    assert bnb.nn.Linear4bit.forward is original and module._LINEAR == linear
    with pytest.raises(KeyError, match="inside"), override.installed_override(force=True):
        assert override.installed()
        raise KeyError("inside")
    assert bnb.nn.Linear4bit.forward is original and module._LINEAR == linear


def test_forced_install_on_cpu_leaves_bitsandbytes_forward(override, monkeypatch):
    """CPU tensors fail the release's eligibility check, so its forward hands them to the forward it
    replaced: output and input gradient bit-identical, Unsloth's kernels never called."""
    import bitsandbytes as bnb

    layer = _linear4bit(256, 48, seed=21, device="cpu")
    g = torch.Generator().manual_seed(22)
    cases = [((3, 5, 256), (3, 5, 48)), ((1, 256), (1, 48))]  # fifteen rows, and one decode row
    data = [(torch.randn(x, generator=g).to(torch.bfloat16), torch.randn(y, generator=g).to(torch.bfloat16))
            for x, y in cases]

    def run():
        results = []
        for x, dy in data:
            with torch.no_grad():
                y = layer(x)
            xg = x.clone().requires_grad_(True)
            yg = layer(xg)
            yg.backward(dy)
            results.append((y, yg.detach(), xg.grad))
        return results

    expect = run()
    called = []

    def refuse(*args, **kwargs):
        called.append(args)
        raise AssertionError("a CPU tensor reached Unsloth's kernels")

    monkeypatch.setattr(override.release, "fast_dequantize", refuse)
    monkeypatch.setattr(override.release, "fast_gemv", refuse)
    assert override.install(force=True)
    assert type(layer).forward is bnb.nn.Linear4bit.forward is override.module._nf4_forward
    got = run()
    assert called == []
    for (x, _), want, have in zip(data, expect, got, strict=True):
        for name, a, b in zip(("output", "output with grad", "input gradient"), have, want, strict=True):
            _assert_same(a, b, f"{tuple(x.shape)} {name}")
    override.uninstall()
    assert bnb.nn.Linear4bit.forward is override.module._FALLBACK["forward"]


# --- GPU -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [True, False], ids=["dq", "flat"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("mode", ["alloc", "out", "global"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_exact_with_bnb(release, dtype, double_quant, mode):
    shapes = [*SHAPES, (4096, 4096 + 64), (11008, 4096)]
    for i, shape in enumerate(shapes):
        for blocksize in (64, 128, 256):
            packed, state = _quantize(shape, dtype, blocksize, double_quant, seed=1000 * i + blocksize, device="cuda")
            expect = _bnb(packed, state)
            name = f"{shape} bs{blocksize} {mode}"
            if mode == "alloc":
                _assert_same(release.fast_dequantize(packed, state), expect, name)
            elif mode == "out":
                out = torch.empty(state.shape, dtype=dtype, device="cuda")
                got = release.fast_dequantize(packed, state, out=out)
                assert got.data_ptr() == out.data_ptr()
                _assert_same(got, expect, name)
            else:
                for repeat in range(3):  # the first call launches and keeps the launch; later ones repeat it
                    got = release.fast_dequantize(packed, state, use_global_buffer=True)
                    _assert_same(got, expect, f"{name} call {repeat}")
                    assert release._dequant_plans.get(state) is not None  # the kept launch is in use
                assert got.data_ptr() == release._scratch_buffers[packed.device.index].data_ptr()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_global_buffer_is_shared_and_plans_follow_the_buffer(release):
    a_packed, a_state = _quantize((256, 512), torch.float16, 64, True, seed=1, device="cuda")
    b_packed, b_state = _quantize((1024, 1024), torch.float16, 64, True, seed=2, device="cuda")
    a = release.fast_dequantize(a_packed, a_state, use_global_buffer=True).clone()
    _assert_same(a, _bnb(a_packed, a_state), "a")
    b = release.fast_dequantize(b_packed, b_state, use_global_buffer=True)  # grows the buffer
    _assert_same(b, _bnb(b_packed, b_state), "b")
    again = release.fast_dequantize(a_packed, a_state, use_global_buffer=True)  # a's kept launch, new buffer
    _assert_same(again, a, "a after the buffer grew")
    assert again.data_ptr() == b.data_ptr()  # one shared buffer: b was overwritten
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # not the default stream: a fresh output, as Unsloth does
        c = release.fast_dequantize(a_packed, a_state, use_global_buffer=True)
    side.synchronize()
    assert c.data_ptr() != again.data_ptr()
    _assert_same(c, a, "a on a side stream")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (333, 1024), (512, 1000)], ids=str)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gemv_close(release, dtype, shape):
    """fast_gemv: close to X @ W.T (not bit-exact: its fp32 accumulation order, by Unsloth's account)."""
    packed, state = _quantize(shape, dtype, 64, True, seed=5, device="cuda")
    weight = _bnb(packed, state)
    g = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(3):  # launch, then the kept launch
        X = torch.randn((1, 1, shape[1]), generator=g, device="cuda").to(dtype)
        got = release.fast_gemv(X, packed, state)
        assert (release._gemv_plans.get(state) is not None) == (shape[1] % 64 == 0)  # the kept launch
        expect = (X.float() @ weight.float().t()).to(dtype)
        assert got.shape == (1, 1, shape[0]) and got.dtype == dtype
        scale = expect.float().abs().max().item()
        torch.testing.assert_close(got.float(), expect.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_forced_override_matches_bitsandbytes(override, monkeypatch):
    """A forced install on a CUDA bf16 NF4 (double-quantized) Linear4bit, against the same layer unpatched.

    2000 rows, more than bitsandbytes' fused 4-bit GEMM takes (1536): bitsandbytes dequantizes and
    calls F.linear (backward: matmul with the dequantized weight), the release does the same with its
    Triton dequantize, so forward and input gradient agree bit for bit.

    One row: the release runs its Triton GEMV, bitsandbytes its one-row kernel (SIMT gemm_4bit): not
    bit-exact. Both are checked against r = x @ W32.T + b in float64, W32 the exact float32 NF4 values
    (code x absmax: bitsandbytes' dequantize to float32), A = |x| @ |W32|.T. Bounds (u = 2^-24 for
    float32, 2^-8 for bf16 rounding):
    - the release sums code x x per 64-block, scales by absmax and accumulates, all in float32: at most
      about (K + K/64) u A = 1.02 * 2^-12 A for K = 4096, then rounds to bf16 and adds the bf16 bias
      in bf16 (two bf16 roundings): within 2^-11 A + 2^-7 (|r| + |b|) of r;
    - bitsandbytes forms each weight as bf16(code) * bf16(scale) and each product with x in bf16 (four
      bf16 roundings per term: at most 1.02 * 2^-6 relative), accumulates in float32 and rounds
      (acc + bias) once: within (2^-6 + 2^-10) A + 2^-7 (|r| + |b|) of r;
    so the two outputs lie within the sum of the two bounds of each other.
    """
    layer = _linear4bit(4096, 1000, seed=31, device="cuda")
    g = torch.Generator().manual_seed(32)
    x = torch.randn(2000, 4096, generator=g).to(torch.bfloat16).cuda()
    dy = torch.randn(2000, 1000, generator=g).to(torch.bfloat16).cuda()
    x1 = torch.randn(1, 4096, generator=g).to(torch.bfloat16).cuda()

    def run():
        with torch.no_grad():
            y, y1 = layer(x), layer(x1)
        xg = x.clone().requires_grad_(True)
        yg = layer(xg)
        yg.backward(dy)
        torch.cuda.synchronize()
        return y, y1, yg.detach(), xg.grad

    y0, y1_0, yg0, gx0 = run()
    calls = {}
    U = override.module._U
    for name in ("fast_dequantize", "fast_gemv"):
        monkeypatch.setattr(U, name, _counted(calls, name, getattr(U, name)))
    assert override.install(force=True) and override.installed()
    assert x.shape[0] > override.module._BNB_FUSED_MAX_ROWS  # past bitsandbytes' fused GEMM: the release's
    y, y1, yg, gx = run()
    # forward without grad, forward with grad, backward; the one row through the GEMV
    assert calls == {"fast_dequantize": 3, "fast_gemv": 1}
    _assert_same(y, y0, "2000 rows, output")
    _assert_same(yg, yg0, "2000 rows, output with grad")
    _assert_same(gx, gx0, "2000 rows, input gradient")

    assert y1.shape == y1_0.shape == (1, 1000) and y1.dtype is torch.bfloat16
    state32 = copy.copy(layer.weight.quant_state)
    state32.dtype = torch.float32
    W32 = _bnb(layer.weight, state32).double()
    xd, b = x1.double(), layer.bias.double()
    r = xd @ W32.t()
    A = xd.abs() @ W32.abs().t()
    tol_release = 2.0**-11 * A + 2.0**-7 * (r.abs() + b.abs())
    tol_bnb = (2.0**-6 + 2.0**-10) * A + 2.0**-7 * (r.abs() + b.abs())
    err = (y1.double() - (r + b)).abs()
    assert (err <= tol_release).all(), f"release GEMV off by {(err / tol_release).max().item():.2f} x its bound"
    diff = (y1.double() - y1_0.double()).abs()
    assert (diff <= tol_release + tol_bnb).all(), f"{(diff / (tol_release + tol_bnb)).max().item():.2f} x the bound"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default_off_on_sm90(override):
    """bitsandbytes >= 0.50 (its fused GEMM): the release is on by default only where every GPU is
    sm100 / sm120; on an H100 / H200 (sm90) it is off."""
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    if {major for major, _ in capabilities} != {9}:
        pytest.skip(f"not an sm90-only machine: {sorted(capabilities)}")
    assert hasattr(torch.ops.bitsandbytes, "gemm_4bit")
    assert override.default_on() is False
