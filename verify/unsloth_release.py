"""Unsloth's released NF4 kernels, run as a peer from the wheel's own files (never copied here).

What it loads: three files of the PyPI wheel `unsloth==2026.10.9`, `unsloth/kernels/nf4.py` (the
one-launch Triton dequantize `dequantize_nf4` and `dequantize_nf4_planned`), `nf4_gemv.py` (the
one-token GEMV `gemv_nf4`, `gemv_nf4_planned`) and `triton_launch.py` (their direct-launch helper).
They import nothing outside torch and triton but `unsloth_zoo.utils.Version`; when the real
`unsloth_zoo` is not importable, a small stand-in of our own is put in `sys.modules` only while
the files are imported. The files run as modules of a private package (`PACKAGE`), so the full
`unsloth` package (and its import-time patching of transformers and friends) is never imported.

A fourth file is pinned and extracted with them but imported only on request:
`unsloth/kernels/bnb_override.py`, the release's replacement of bitsandbytes' `Linear4bit.forward`
(install / uninstall functions, and its own rule for when it is on by default). It reaches the
kernels only through `from . import utils`, the release's `unsloth/kernels/utils.py`, which cannot
be imported without the whole package. `Release.bnb_override()` therefore first puts a module of
ours at `PACKAGE.kernels.utils` offering the three names the override uses (`fast_dequantize` and
`fast_gemv`, which hand over to `Release.fast_dequantize` / `Release.fast_gemv`, and the flag
`_USE_NF4_KERNELS`, True), then imports the released file unchanged on top of it; the `Override`
it returns installs, uninstalls and reports on the release's forward (see `Override`).

Why this way: Unsloth is AGPL-3.0. Its code must never be copied into this repository, not even a
line; it is run as a peer, from the released files, checked against pinned sha256 hashes. What this
module adds is ours: the loading, `Release.fast_dequantize` / `Release.fast_gemv`, which pass
a QuantState's fields to those entry points as the release's `unsloth/kernels/utils.py`
(`fast_dequantize`, `fast_gemv`, CUDA branch) does, written here from reading it, and the
stand-in `utils` module and `Override` around the released override.

How to fetch (the files live in the git-ignored `.peers/`, which also travels to the GPU machine):

    python3 -m pip download --no-deps -d /tmp/peers unsloth==2026.10.9
    python -m verify.unsloth_release extract /tmp/peers/unsloth-2026.10.9-py3-none-any.whl

The second command checks the wheel's sha256, checks each file against the wheel's RECORD, and
writes `<repo>/.peers/unsloth-2026.10.9/unsloth/kernels/{nf4,nf4_gemv,triton_launch,bnb_override}.py`
(the wheel's layout), the wheel's license files, and `MANIFEST.json` (wheel name and sha256, each
file's sha256). `load()` looks for the folder in its argument, else `$NF4_UNSLOTH_DIR`, else there.
A folder extracted before the override was pinned fails the check: extract it again.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import types
import weakref
import zipfile
from functools import total_ordering
from pathlib import Path

VERSION = "2026.10.9"
WHEEL = f"unsloth-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "feb40b99bc4f8c543a36cbd0fe6e1410d6e4ac16bd4d0c731f607adce3d63bb0"
# The kernel files that `load()` imports, in import order (each imports only the ones before it), with their sha256.
KERNEL_FILES = {
    "unsloth/kernels/triton_launch.py": "e7028f1c76f6c1a7d6085694823d70603e45dcce392a5b10f4dd0300ea133ada",
    "unsloth/kernels/nf4.py": "f4dd101d1dd86e46a1e096aea1ad19fb27d8e39233cfb99a61240ca495d44a52",
    "unsloth/kernels/nf4_gemv.py": "65cb275129e4cd5255c9b29da1c582133ea3f37a92656888803fdda22125c98b",
}
# The release's replacement of bitsandbytes' Linear4bit.forward, imported only by `Release.bnb_override()`.
OVERRIDE_FILE = "unsloth/kernels/bnb_override.py"
OVERRIDE_SHA256 = "bfc17983facbe2b5cf96352caa4d3bd510d75d554b20ed0dfd7279dd02651599"
# Every pinned file: what `extract` copies, MANIFEST.json lists and `verify_release` checks.
FILES = {**KERNEL_FILES, OVERRIDE_FILE: OVERRIDE_SHA256}
LICENSES = (f"unsloth-{VERSION}.dist-info/licenses/COPYING", f"unsloth-{VERSION}.dist-info/licenses/LICENSE")
MANIFEST = "MANIFEST.json"
ENV = "NF4_UNSLOTH_DIR"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / ".peers" / f"unsloth-{VERSION}"
PACKAGE = "_nf4_peer_unsloth_" + VERSION.replace(".", "_")  # its modules: PACKAGE.kernels.nf4, ...
PIP_DOWNLOAD = f"python3 -m pip download --no-deps -d /tmp/peers unsloth=={VERSION}"
EXTRACT = f"python -m verify.unsloth_release extract /tmp/peers/{WHEEL}"


class IntegrityError(RuntimeError):
    """The extracted release does not match its manifest or the pinned hashes."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def release_root(root: str | os.PathLike | None = None) -> Path:
    """The folder to load from: `root`, else $NF4_UNSLOTH_DIR, else <repo>/.peers/unsloth-2026.10.9."""
    if root is None:
        root = os.environ.get(ENV) or DEFAULT_ROOT
    return Path(root).expanduser().resolve()


def _missing(root: Path, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"Unsloth {VERSION} release files not found: {what} (looked in {root}; set {ENV} or pass root=).\n"
        f"Fetch and extract them (they are AGPL-3.0: run as a peer, never copied into the repository):\n"
        f"    {PIP_DOWNLOAD}\n"
        f"    {EXTRACT}\n"
        f"which writes {DEFAULT_ROOT}/unsloth/kernels/{{{','.join(Path(rel).stem for rel in FILES)}}}.py "
        f"and {MANIFEST}."
    )


def verify_release(root: str | os.PathLike | None = None, *, expected: dict[str, str] | None = None,
                   wheel_sha256: str | None = WHEEL_SHA256) -> dict:
    """Check the extracted release and return its manifest (a dict).

    Every file of `expected` (default: the pinned `FILES`) must exist, hash as pinned and as the
    manifest says, and the manifest must name this version and the pinned wheel hash (unless
    `wheel_sha256` is None). FileNotFoundError when something is missing, IntegrityError otherwise.
    """
    root = release_root(root)
    expected = FILES if expected is None else expected
    if not root.is_dir():
        raise _missing(root, "no such folder")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise _missing(root, f"no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as error:
        raise IntegrityError(f"{manifest_path}: not JSON ({error})") from error
    if manifest.get("version") != VERSION:
        raise IntegrityError(f"{manifest_path}: version {manifest.get('version')!r}, expected {VERSION!r}")
    if wheel_sha256 is not None and manifest.get("wheel_sha256") != wheel_sha256:
        raise IntegrityError(f"{manifest_path}: wheel_sha256 {manifest.get('wheel_sha256')!r}, pinned {wheel_sha256}")
    listed = manifest.get("files") or {}
    if set(listed) != set(expected):
        raise IntegrityError(f"{manifest_path}: files {sorted(listed)}, expected {sorted(expected)}; "
                             f"extract them again from the wheel ({EXTRACT})")
    for rel, pinned in expected.items():
        path = root / rel
        if not path.is_file():
            raise _missing(root, f"no {rel}")
        actual = sha256_file(path)
        if actual != listed[rel] or actual != pinned:
            raise IntegrityError(f"{path}: sha256 {actual}, manifest {listed[rel]}, pinned {pinned}: "
                                 f"the file was modified; extract it again from the wheel ({EXTRACT})")
    return manifest


def provenance(root: str | os.PathLike | None = None) -> dict:
    """{peer, version, wheel_sha256, files} of the (verified) extracted release, for every result row."""
    manifest = verify_release(root)
    return {"peer": "unsloth", "version": VERSION, "wheel_sha256": manifest["wheel_sha256"],
            "files": dict(manifest["files"])}


# --- extraction: our code, reading the wheel (a zip) ------------------------------------------


def _record_hashes(wheel: zipfile.ZipFile) -> dict[str, str]:
    """{path: sha256 hex} from the wheel's RECORD (which stores urlsafe base64 digests)."""
    names = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if len(names) != 1:
        raise IntegrityError(f"wheel has {len(names)} RECORD files")
    found = {}
    for line in wheel.read(names[0]).decode().splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3 and parts[1].startswith("sha256="):
            digest = parts[1][len("sha256="):]
            found[parts[0]] = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return found


def extract(wheel: str | os.PathLike, dest: str | os.PathLike | None = None, *,
            expected: dict[str, str] | None = None, wheel_sha256: str | None = WHEEL_SHA256,
            licenses: tuple[str, ...] = LICENSES) -> Path:
    """Copy the pinned files (and license files) out of the wheel into `dest`, write MANIFEST.json.

    The wheel must hash as pinned (unless `wheel_sha256` is None) and every file as the wheel's
    RECORD and `expected` (default `FILES`) say. Returns the folder (default DEFAULT_ROOT).
    """
    wheel = Path(wheel)
    dest = DEFAULT_ROOT if dest is None else Path(dest)
    expected = FILES if expected is None else expected
    digest = sha256_file(wheel)
    if wheel_sha256 is not None and digest != wheel_sha256:
        raise IntegrityError(f"{wheel}: sha256 {digest}, pinned {wheel_sha256} (not unsloth=={VERSION}?)")
    files, license_hashes = {}, {}
    with zipfile.ZipFile(wheel) as zf:
        record = _record_hashes(zf)
        for rel in (*expected, *licenses):
            data = zf.read(rel)
            actual = sha256_bytes(data)
            if record.get(rel) != actual:
                raise IntegrityError(f"{wheel}:{rel}: sha256 {actual}, RECORD {record.get(rel)}")
            if rel in expected and expected[rel] != actual:
                raise IntegrityError(f"{wheel}:{rel}: sha256 {actual}, pinned {expected[rel]}")
            (files if rel in expected else license_hashes)[rel] = actual
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    manifest = {
        "peer": "unsloth",
        "version": VERSION,
        "license": "AGPL-3.0 (run as a peer from the wheel's files; never copy into the repository)",
        "wheel": wheel.name,
        "wheel_sha256": digest,
        "files": files,
        "licenses": license_hashes,
        "fetch": [PIP_DOWNLOAD, EXTRACT],
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


# --- the `unsloth_zoo.utils.Version` stand-in ----------------------------------------------------


@total_ordering
class ShimVersion:
    """A comparable version, for the release's `Version(triton.__version__) >= Version("3.7.0")`.

    It follows `unsloth_zoo.utils.Version`'s documented reading of a version string: the leading
    dotted number counts, and anything after it (".dev", "rc1", "+git...") makes the version one
    step above that number ("3.7.0+git1" compares above "3.7.0"). Trailing zeros do not count.
    Only strings are accepted (the release passes nothing else).
    """

    def __init__(self, version):
        if isinstance(version, ShimVersion):
            self.parts = version.parts
            return
        text = str(version)
        match = re.match(r"[0-9]+(?:\.[0-9]+)*", text)
        at_start = match is not None
        match = match or re.search(r"[0-9]+(?:\.[0-9]+)*", text)
        if match is None:
            raise ValueError(f"not a version: {text!r}")
        parts = [int(p) for p in match.group(0).split(".")]
        if at_start and match.group(0) != text:
            parts.append(1)
        while len(parts) > 1 and parts[-1] == 0:
            parts.pop()
        self.parts = tuple(parts)

    def __eq__(self, other):
        return self.parts == ShimVersion(other).parts

    def __lt__(self, other):
        return self.parts < ShimVersion(other).parts

    def __hash__(self):
        return hash(self.parts)

    def __repr__(self):
        return f"ShimVersion({'.'.join(map(str, self.parts))!r})"


def version_shim_needed() -> bool:
    """True when `unsloth_zoo.utils` is neither imported already nor importable."""
    if "unsloth_zoo.utils" in sys.modules:
        return False
    try:
        return importlib.util.find_spec("unsloth_zoo") is None
    except (ImportError, ValueError):
        return True


@contextlib.contextmanager
def _version_provider():
    """While the release's files are imported: the real `unsloth_zoo.utils`, else a stand-in module
    holding ShimVersion in sys.modules, removed again afterwards. Yields whether it is the stand-in."""
    if not version_shim_needed():
        yield False
        return
    zoo = types.ModuleType("unsloth_zoo")
    zoo.__path__ = []
    utils = types.ModuleType("unsloth_zoo.utils")
    utils.__doc__ = "nf4-triton's stand-in for unsloth_zoo.utils: Version only (verify/unsloth_release.py)."
    utils.Version = ShimVersion
    zoo.utils = utils
    added = [name for name in ("unsloth_zoo", "unsloth_zoo.utils") if name not in sys.modules]
    sys.modules.setdefault("unsloth_zoo", zoo)
    sys.modules["unsloth_zoo.utils"] = utils
    try:
        yield True
    finally:
        for name in added:
            sys.modules.pop(name, None)


# --- importing the files ---------------------------------------------------------------------------


class _VerifiedLoader(importlib.machinery.SourceFileLoader):
    """Compiles exactly the bytes whose sha256 is pinned; writes no bytecode into the release folder."""

    def __init__(self, fullname, path, sha256):
        super().__init__(fullname, path)
        self.sha256 = sha256

    def get_code(self, fullname):
        data = self.get_data(self.path)
        if sha256_bytes(data) != self.sha256:
            raise IntegrityError(f"{self.path} changed while loading")
        return compile(data, self.path, "exec", dont_inherit=True)


def _package(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__path__ = []  # nothing is found by searching: every module is put here explicitly
    module.__package__ = name
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return module


def _import_file(root: Path, rel: str, sha: str, created: list[str]) -> types.ModuleType:
    """Import one file as PACKAGE.kernels.<stem> through the verified loader (the package must exist);
    its name is appended to `created` before it runs, so a caller can undo a failed import."""
    stem = Path(rel).stem
    name = f"{PACKAGE}.kernels.{stem}"
    path = str(root / rel)
    spec = importlib.util.spec_from_file_location(name, path, loader=_VerifiedLoader(name, path, sha))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    created.append(name)
    spec.loader.exec_module(module)
    setattr(sys.modules[f"{PACKAGE}.kernels"], stem, module)
    return module


def _import_release(root: Path, files: dict[str, str]) -> dict[str, types.ModuleType]:
    """Import the files as PACKAGE.kernels.<stem> (relative imports resolve inside PACKAGE.kernels)."""
    import torch

    if hasattr(torch.ops.unsloth, "dequantize_nf4"):
        raise RuntimeError("torch.ops.unsloth.dequantize_nf4 is already registered: Unsloth's NF4 kernels are loaded "
                           "in this process already (the real unsloth package?); they can be loaded once only")
    created = [PACKAGE, f"{PACKAGE}.kernels"]
    sys.modules[PACKAGE] = _package(PACKAGE, f"Unsloth {VERSION} NF4 kernel files from {root} (AGPL-3.0, a peer)")
    sys.modules[created[1]] = kernels = _package(created[1], None)
    sys.modules[PACKAGE].kernels = kernels
    modules = {}
    try:
        for rel, sha in files.items():
            modules[Path(rel).stem] = _import_file(root, rel, sha, created)
    except BaseException:
        for name in created:
            sys.modules.pop(name, None)
        raise
    return modules


# --- the release's bnb_override.py, on a stand-in for the release's utils.py ----------------------


def _utils_standin(release: Release) -> types.ModuleType:
    """Our module put at PACKAGE.kernels.utils before the release's bnb_override.py is imported: the
    three names that file takes from the release's utils.py, and nothing else."""
    name = f"{PACKAGE}.kernels.utils"
    module = types.ModuleType(name, (
        f"nf4-triton's stand-in (verify/unsloth_release.py), not Unsloth's code: it stands for the release's "
        f"unsloth/kernels/utils.py, which imports the whole unsloth package, and offers only what "
        f"{OVERRIDE_FILE} uses from it: fast_dequantize and fast_gemv (handing over to Release.fast_dequantize "
        f"and Release.fast_gemv, our statement of that file's NF4 CUDA path) and _USE_NF4_KERNELS (True)."))

    def fast_dequantize(W, quant_state=None, out=None, use_global_buffer=False, dtype=None):
        # The release's utils.py uses `dtype` only for FP8 weights (the dequantized dtype); an NF4
        # QuantState dequantizes to its own dtype, so `dtype` is ignored here. (The release's function
        # also runs under torch.inference_mode; this one does not: the same values, a plain tensor.)
        return release.fast_dequantize(W, quant_state, out=out, use_global_buffer=use_global_buffer)

    def fast_gemv(X, W, quant_state, out=None):
        return release.fast_gemv(X, W, quant_state, out=out)

    for function in (fast_dequantize, fast_gemv):
        function.__module__ = name
        function.__qualname__ = function.__name__
        setattr(module, function.__name__, function)
    module._USE_NF4_KERNELS = True  # the release's flag: its NF4 kernels loaded and have not failed
    return module


def _import_override(release: Release) -> types.ModuleType:
    """The release's bnb_override.py as PACKAGE.kernels.bnb_override, on our stand-in utils."""
    verify_release(release.root)  # every pinned file, the override among them, still as extracted
    if sys.modules.get(f"{PACKAGE}.kernels") is not release.kernels_package:
        raise RuntimeError(f"{PACKAGE}.kernels is not the package {release!r} was loaded into")
    utils_name = f"{PACKAGE}.kernels.utils"
    created = [utils_name]
    sys.modules[utils_name] = release.kernels_package.utils = _utils_standin(release)
    try:
        with _version_provider():
            return _import_file(release.root, OVERRIDE_FILE, OVERRIDE_SHA256, created)
    except BaseException:
        for name in created:
            sys.modules.pop(name, None)
            if hasattr(release.kernels_package, name.rsplit(".", 1)[1]):
                delattr(release.kernels_package, name.rsplit(".", 1)[1])
        raise


class Override:
    """The release's `bnb_override.py` (its `Linear4bit.forward` replacement), loaded by `Release.bnb_override()`.

    `module` is the released module itself. The release installs itself only where its own rule says
    (`default_on()`) unless UNSLOTH_BNB_NF4_LINEAR=1 was set when it was imported; `install(force=True)`
    has that effect by setting the module's `_LINEAR` (what it read from that variable) to "1", and
    `uninstall()` puts the read value back. UNSLOTH_BNB_TRITON=0 (read at import) still refuses.
    """

    def __init__(self, release: Release, module: types.ModuleType):
        self.release = release
        self.module = module
        self.file = OVERRIDE_FILE
        self.sha256 = release.files[OVERRIDE_FILE]
        self._linear = module._LINEAR  # UNSLOTH_BNB_NF4_LINEAR as the module read it ("auto" when unset)
        self.forced = False  # whether the last install() forced it

    def provenance(self) -> dict:
        return {**self.release.provenance(), "override": self.file}

    def __repr__(self):
        return f"<Unsloth {self.release.version} {self.file}{' (installed)' if self.installed() else ''}>"

    def default_on(self) -> bool:
        """The release's own decision for this machine with UNSLOTH_BNB_NF4_LINEAR unset: its
        `_default_on` with every CUDA GPU's capability (none without CUDA: False), whether
        bitsandbytes has its fused 4-bit GEMM (the release's `_bnb_has_fused_gemm`), and ROCm."""
        import bitsandbytes  # noqa: F401 - registers torch.ops.bitsandbytes.*, which the release looks for
        import torch

        capabilities = ([tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
                        if torch.cuda.is_available() else [])
        return bool(self.module._default_on(capabilities, self.module._bnb_has_fused_gemm(),
                                            torch.version.hip is not None))

    def install(self, force: bool = False) -> bool:
        """The release's `install_bnb_nf4_override()` (its result: whether its forward is installed);
        with `force`, as under UNSLOTH_BNB_NF4_LINEAR=1."""
        if force:
            self.module._LINEAR = "1"
            self.forced = True
        return bool(self.module.install_bnb_nf4_override())

    def uninstall(self) -> None:
        """The release's `uninstall_bnb_nf4_override()` (puts back the forward it replaced); `_LINEAR`
        goes back to the value read at import."""
        try:
            self.module.uninstall_bnb_nf4_override()
        finally:
            self.module._LINEAR = self._linear
            self.forced = False

    def installed(self) -> bool:
        """Whether bitsandbytes' `Linear4bit.forward` is now the release's replacement (it carries the
        release's mark attribute)."""
        import bitsandbytes as bnb

        return bool(getattr(bnb.nn.Linear4bit.forward, self.module._MARK, False))

    @contextlib.contextmanager
    def installed_override(self, force: bool = False):
        """`install(force)` for the block (yields its result), then `uninstall()`, whatever happens."""
        try:
            yield self.install(force=force)
        finally:
            self.uninstall()


# --- the release object, and Unsloth's fast_dequantize / fast_gemv argument plumbing -------------


def _unpack(quant_state):
    """(absmax, shape, dtype, blocksize, code, code2, absmax2, offset, blocksize2) of a QuantState,
    as the release's utils.py hands them to its kernels: the nested fields None and blocksize2 0
    without double quantization, and the offset as a float32 tensor on absmax's device."""
    import torch

    if isinstance(quant_state, list):
        raise TypeError("the legacy list form of a quant state is not supported here; pass a QuantState")
    state2 = quant_state.state2
    if state2 is None:
        return (quant_state.absmax, quant_state.shape, quant_state.dtype, quant_state.blocksize,
                quant_state.code, None, None, None, 0)
    offset = quant_state.offset
    if not isinstance(offset, torch.Tensor):
        offset = torch.tensor(offset, dtype=torch.float32, device=quant_state.absmax.device)
    return (quant_state.absmax, quant_state.shape, quant_state.dtype, quant_state.blocksize, quant_state.code,
            state2.code, state2.absmax, offset, state2.blocksize)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Plans:
    """One cached launch per QuantState (Unsloth keeps it as an attribute of the state; this keeps it
    beside, so the caller's object is left alone). Keyed by identity; dropped with the state."""

    def __init__(self):
        self._by_id = {}

    def get(self, state):
        item = self._by_id.get(id(state))
        return item[1] if item is not None and item[0]() is state else None

    def put(self, state, plan):
        key = id(state)
        self._by_id[key] = (weakref.ref(state, lambda _ref, key=key: self._by_id.pop(key, None)), plan)

    def drop(self, state):
        if self.get(state) is not None:
            del self._by_id[id(state)]


class Release:
    """The loaded release: provenance, the raw entry points, and fast_dequantize / fast_gemv.

    Raw entry points (the release's own functions, see the release files for their full contracts):
      dequantize_nf4(W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype, out=None)
      dequantize_nf4_planned(W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, out)
          -> a rerun(out) function repeating the launch, or None
      gemv_nf4(X, W_u8, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype, out=None)
      gemv_nf4_planned(X, W_u8, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, out)
          -> a rerun(X, out) function, or None
    """

    def __init__(self, root: Path, manifest: dict, modules: dict, shim: bool):
        self.root = root
        self.version = VERSION
        self.wheel = manifest.get("wheel", WHEEL)
        self.wheel_sha256 = manifest["wheel_sha256"]
        self.files = dict(manifest["files"])
        self.shim = shim  # True when unsloth_zoo.utils.Version was our ShimVersion
        self.modules = modules
        self.nf4 = modules["nf4"]
        self.nf4_gemv = modules["nf4_gemv"]
        self.triton_launch = modules["triton_launch"]
        self.dequantize_nf4 = self.nf4.dequantize_nf4
        self.dequantize_nf4_planned = self.nf4.dequantize_nf4_planned
        self.gemv_nf4 = self.nf4_gemv.gemv_nf4
        self.gemv_nf4_planned = self.nf4_gemv.gemv_nf4_planned
        self._scratch_buffers = {}
        self._default_streams = {}
        self._dequant_plans = _Plans()
        self._gemv_plans = _Plans()
        self.kernels_package = sys.modules.get(f"{PACKAGE}.kernels")  # PACKAGE.kernels, where the files live
        self._override = None

    def provenance(self) -> dict:
        return {"peer": "unsloth", "version": self.version, "wheel_sha256": self.wheel_sha256,
                "files": dict(self.files)}

    def __repr__(self):
        return f"<Unsloth {self.version} NF4 kernels from {self.root}{' (Version shim)' if self.shim else ''}>"

    def bnb_override(self) -> Override:
        """The release's bnb_override.py, imported (once per Release) on our stand-in for its utils.py
        (see the module docstring and `Override`). Importing it changes nothing in bitsandbytes."""
        if self._override is None:
            self._override = Override(self, _import_override(self))
        return self._override

    # Unsloth's conditions for its Triton path (utils.py); elsewhere it would run bitsandbytes' kernels.
    @staticmethod
    def triton_path_refused(device) -> str | None:
        """Why Unsloth would not take its Triton NF4 path for a tensor on `device` (None: it would)."""
        import torch

        if os.environ.get("UNSLOTH_BNB_TRITON", "1") == "0":
            return "UNSLOTH_BNB_TRITON=0: Unsloth would use bitsandbytes' ctypes kernels"
        if device.type == "cuda" and torch.version.hip is None and any(
                torch.cuda.get_device_capability(i)[0] < 7 for i in range(torch.cuda.device_count())):
            return "a GPU below sm_70: Unsloth would use bitsandbytes' ctypes kernels"
        return None

    def _scratch_allowed(self, device) -> bool:
        """Unsloth's use_global_buffer condition: eager, not capturing, on the device's default stream."""
        import torch

        if device.type != "cuda" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        default = self._default_streams.get(device.index)
        if default is None:
            default = self._default_streams[device.index] = torch.cuda.default_stream(device).cuda_stream
        return torch._C._cuda_getCurrentRawStream(device.index) == default

    def _scratch(self, device, numel, dtype):
        """The shared weight buffer of `device`: kept while big enough and of `dtype`, else replaced."""
        import torch

        buffer = self._scratch_buffers.get(device.index)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            with torch.inference_mode(False):
                buffer = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
            self._scratch_buffers[device.index] = buffer
        return buffer[:numel]

    def fast_dequantize(self, W, quant_state, out=None, use_global_buffer=False):
        """Unsloth 2026.10.9's `fast_dequantize` for an NF4 QuantState on CUDA, Triton path.

        The plumbing of the release's utils.py, in our words (it is some 60 lines there, not a few):
        unpack the QuantState (`_unpack`); with `out` given, it must have the state's shape and dtype;
        with use_global_buffer on the default stream of the current device and no `out`, the weight
        goes into a per-device scratch buffer (reused, so the result is overwritten by the next call)
        through `dequantize_nf4_planned`, whose returned rerun(out) is kept for this state and
        repeats the launch on later calls for the same weight tensor (no argument handling at all);
        with use_global_buffer elsewhere, into the scratch buffer through `dequantize_nf4(out=...)`;
        otherwise `dequantize_nf4` allocates. The result is transposed when W.shape[0] == 1.
        Differences: where Unsloth would catch a kernel failure and fall back to bitsandbytes, or not
        take the Triton path at all (fp4, UNSLOTH_BNB_TRITON=0, < sm_70), this raises; its FSDP2
        gathered-weight plan reuse is not mirrored.
        """
        import torch

        if quant_state is None:
            return W
        if getattr(quant_state, "quant_type", "nf4") != "nf4":
            raise ValueError("not NF4: Unsloth hands this quant type to bitsandbytes' dequantize_4bit")
        device = W.device
        refused = self.triton_path_refused(device)
        if refused:
            raise RuntimeError(refused)
        scratch_ok = bool(use_global_buffer) and self._scratch_allowed(device)
        planned = out is None and scratch_ok and device.index == torch.cuda.current_device()
        if planned:
            plan = self._dequant_plans.get(quant_state)
            if plan is not None and plan["W_ptr"] == W.data_ptr() and plan["absmax"] is quant_state.absmax \
                    and plan["dtype"] is quant_state.dtype:
                if self._scratch_buffers.get(device.index) is plan["buffer"]:
                    out = plan["out"]
                else:
                    shape = quant_state.shape
                    out = self._scratch(device, shape[0] * shape[1], plan["dtype"]).view(shape)
                    plan["buffer"], plan["out"] = self._scratch_buffers[device.index], out
                try:
                    done = plan["rerun"](out)
                except Exception:
                    done = False
                if done:
                    return out.t() if W.shape[0] == 1 else out
                self._dequant_plans.drop(quant_state)
                out = None
        absmax, shape, dtype, blocksize, code, code2, absmax2, offset, blocksize2 = _unpack(quant_state)
        if out is not None:
            assert out.shape == shape
            assert out.dtype == dtype
        elif scratch_ok:
            out = self._scratch(device, shape[0] * shape[1], dtype).view(shape)
        if planned and dtype in (torch.float16, torch.bfloat16, torch.float32) and _pow2(blocksize) \
                and (code2 is None or _pow2(blocksize2)):
            rerun = self.dequantize_nf4_planned(W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, out)
            if rerun is not None:
                self._dequant_plans.put(quant_state, {"W_ptr": W.data_ptr(), "absmax": absmax, "dtype": dtype,
                                                      "rerun": rerun, "buffer": self._scratch_buffers.get(device.index),
                                                      "out": out, "W": W})
        else:
            out = self.dequantize_nf4(W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype,
                                      out=out)
        return out.t() if W.shape[0] == 1 else out

    def fast_gemv(self, X, W, quant_state, out=None):
        """Unsloth 2026.10.9's `fast_gemv` (one decode token, X of shape (1, 1, K)), Triton path.

        As the release's utils.py does it: an eager call with contiguous X on the current device first
        tries this state's kept rerun(X, out); a weight whose rows do not start a quantization block
        (K % blocksize) is dequantized and multiplied instead; an eager (1, 1, K) call launches through
        `gemv_nf4_planned` and keeps its rerun; anything else calls `gemv_nf4`. Returns (1, 1, N) in
        X's dtype. Not bit-exact with bitsandbytes (fp32 accumulation order), by Unsloth's own account.
        """
        import torch

        if quant_state is None:
            return torch.matmul(X, W, out=out)
        compiling = torch.compiler.is_compiling()
        refused = self.triton_path_refused(X.device)
        if not refused and not (self.nf4_gemv.triton_gemv_eager() or compiling):
            refused = "UNSLOTH_TRITON_GEMV_EAGER=0: Unsloth would use bitsandbytes' GEMV"
        if refused:
            raise RuntimeError(refused)
        eager = not compiling and X.is_contiguous() and X.device.index == torch.cuda.current_device()

        def out_fits(out):
            return out is None or (out.dtype is X.dtype and out.data_ptr() & 15 == 0)

        if eager:
            plan = self._gemv_plans.get(quant_state)
            if plan is not None and plan["W_ptr"] == W.data_ptr() and plan["absmax"] is quant_state.absmax \
                    and plan["dtype"] is X.dtype and X.data_ptr() & 15 == plan["X_align"] and out_fits(out):
                if out is None:
                    out = torch.empty((1, 1, plan["N"]), dtype=X.dtype, device=X.device)
                try:
                    done = plan["rerun"](X, out)
                except Exception:
                    done = False
                if done:
                    return out
                self._gemv_plans.drop(quant_state)
        absmax, shape, dtype, blocksize, code, code2, absmax2, offset, blocksize2 = _unpack(quant_state)
        if shape[1] % blocksize != 0:
            return torch.matmul(X, self.fast_dequantize(W, quant_state).t(), out=out)
        if eager and X.dim() == 3 and X.shape[0] == 1 and X.shape[1] == 1 and out_fits(out):
            if out is None:
                out = torch.empty((1, 1, int(shape[0])), dtype=X.dtype, device=X.device)
            rerun = self.gemv_nf4_planned(X, W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape,
                                          out)
            if rerun is not None:
                self._gemv_plans.put(quant_state, {"W_ptr": W.data_ptr(), "absmax": absmax, "dtype": X.dtype,
                                                   "X_align": X.data_ptr() & 15, "N": int(shape[0]),
                                                   "rerun": rerun})
            return out
        return self.gemv_nf4(X, W, absmax, code2, absmax2, offset, code, blocksize, blocksize2, shape, dtype, out=out)


_LOADED: list[Release] = []  # the release of this process: the files register torch.ops.unsloth.* once


def load(root: str | os.PathLike | None = None) -> Release:
    """Verify and import the extracted release (see the module docstring); once per process.

    A second call returns the same Release when its files hash the same; the kernels register
    `torch.ops.unsloth.*` operators, so a different copy cannot be loaded beside them.
    """
    path = release_root(root)
    manifest = verify_release(path)
    if _LOADED:
        loaded = _LOADED[0]
        if loaded.files != manifest["files"]:
            raise RuntimeError(f"{loaded!r} is loaded already; {path} holds other files")
        return loaded
    with _version_provider() as shim:
        modules = _import_release(path, KERNEL_FILES)
    release = Release(path, manifest, modules, shim)
    _LOADED.append(release)
    return release


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verify.unsloth_release", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help=f"extract the pinned files of {WHEEL} and write {MANIFEST}")
    ex.add_argument("wheel", type=Path)
    ex.add_argument("--dest", type=Path, default=None, help=f"default {DEFAULT_ROOT}")
    ck = sub.add_parser("check", help="verify the extracted files and print their provenance")
    ck.add_argument("root", nargs="?", default=None)
    args = parser.parse_args(argv)
    if args.command == "extract":
        print(extract(args.wheel, args.dest))
    else:
        print(json.dumps(provenance(args.root), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
