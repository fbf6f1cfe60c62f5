"""The shipped `vibevoice` policy on the original community implementation (PyPI `vibevoice` 0.0.1).

That package pins transformers 4.51.3 and registers configs named like transformers 5's own
VibeVoice, so it cannot share a process with the rest of the suite. The test builds a separate
virtual environment that holds its own transformers, diffusers, accelerate and vibevoice, and sees
this environment's torch, streamwise (an editable install included) and other packages through a
`.pth` file that appends this environment's site-packages after its own; it runs
tests/community/check_community.py there.

The first run builds that environment with pip (about 30 s); later runs reuse it. It is cached under
the system temp directory (`<tempdir>/streamwise-test-cache-<uid>`, e.g.
`/tmp/streamwise-test-cache-1000`), never in your home unless you opt in by setting
`STREAMWISE_CACHE`, e.g. `STREAMWISE_CACHE=~/.cache/streamwise` to keep it across reboots. Its name
hashes the Python, this environment's prefix, the checkout streamwise is imported from, torch's version,
the pins and the build recipe, so a change to any of them (a second checkout too) builds a fresh one,
and a cached one that no longer finds its packages (say, this environment was deleted and made again)
is rebuilt. Concurrent runs wait on a lock file beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import site
import subprocess
import sys
import venv
from importlib.util import find_spec
from pathlib import Path

import pytest

from helpers import TESTS, cache_dir

REQUIREMENTS = ["transformers==4.51.3", "diffusers==0.35.2"]
NO_DEPS = ["vibevoice==0.0.1", "accelerate==1.6.0"]  # the package's own pins; its app extras are not needed
RECIPE = 2  # bump whenever community_python() builds differently, so old caches are not reused

SHARED = ("torch", "streamwise")  # found through this environment
PROBE = """
import importlib.metadata, importlib.util, json, sys
if sys.argv[1] == "import":
    import accelerate, diffusers, streamwise, torch, transformers, vibevoice
print(json.dumps({"versions": {name: importlib.metadata.version(name) for name in sys.argv[2:]},
                  "origins": {name: getattr(importlib.util.find_spec(name), "origin", None) for name in sys.argv[2:]}}))
"""


def active_site_dirs() -> list[str]:
    """This environment's site-packages in the order `site` adds them: the user site first where enabled."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return [path for path in dict.fromkeys([*user, *site.getsitepackages()]) if os.path.isdir(path)]


def probe_failure(root: Path, *, imports: bool) -> str | None:
    """Why the environment at `root` is unusable, or None. Its own pinned packages must come first on its
    path and this environment's torch and streamwise must be the ones it finds; with `imports` it must also
    import them all (seconds, so only right after a build; the quick check takes a tenth of one)."""
    pins = dict(requirement.split("==") for requirement in [*REQUIREMENTS, *NO_DEPS])
    python = root / "bin" / "python"
    if not python.exists():
        return f"{python} is missing"
    result = subprocess.run([str(python), "-c", PROBE, "import" if imports else "find", *pins, *SHARED],
                            capture_output=True, text=True, env=clean_env())
    if result.returncode != 0:
        return result.stderr[-4000:]
    found = json.loads(result.stdout)
    expected = {**pins, **{name: importlib.metadata.version(name) for name in SHARED}}
    if found["versions"] != expected:
        return f"versions {found['versions']}, expected {expected}"
    for name, origin in found["origins"].items():
        if origin is None:
            return f"{name} not found"
        own = Path(origin).resolve().is_relative_to(root.resolve())
        if own != (name in pins) or name in SHARED and Path(origin).resolve() != Path(find_spec(name).origin).resolve():
            return f"{name} from {origin}"
    return None


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STREAMWISE_POLICY_PATH")}


def build(root: Path) -> None:
    # No system site-packages: they would be the base interpreter's, not this (virtual) environment's.
    venv.EnvBuilder(clear=True, with_pip=True).create(root)
    python = str(root / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True, env=clean_env()).stdout.strip()
    # Appended after the environment's own site-packages, so its transformers wins over this one's;
    # addsitedir also runs the .pth files there, which is how an editable streamwise is found.
    Path(own, "streamwise-active-env.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in active_site_dirs()), encoding="utf-8")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS], check=True, env=clean_env())
    subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True, env=clean_env())


def community_python() -> Path:
    checkout = str(Path(find_spec("streamwise").origin).resolve().parent)  # each checkout has its own environment
    recipe = [f"recipe={RECIPE}", sys.version, sys.executable, sys.prefix, checkout, *active_site_dirs(),
              f"torch=={importlib.metadata.version('torch')}", *REQUIREMENTS, *NO_DEPS]
    key = hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:12]
    cache = cache_dir()
    root = cache / f"community-vibevoice-{key}"
    python = root / "bin" / "python"
    with open(cache / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (root / "ready").exists() and probe_failure(root, imports=False) is None:
            return python
        (root / "ready").unlink(missing_ok=True)
        build(root)
        failure = probe_failure(root, imports=True)
        assert failure is None, f"the community environment at {root} does not work: {failure}"
        (root / "ready").touch()
    return python


@pytest.fixture(scope="module")
def report():
    result = subprocess.run(
        [str(community_python()), str(TESTS / "community" / "check_community.py")],
        capture_output=True, text=True, env=clean_env(), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_full_size_community_model_is_covered_completely(report, snapshot):
    plan = report["plan"]
    assert plan["complete"] and plan["stranded"] == []
    # on meta nothing can be probed yet: the community norms' kinds are proven only by the probe on real weights
    # (the round-trip test below loads them)
    assert [d.split(":", 1)[0] for d in plan["diagnostics"]] == ["warning[unproven-kind]"] * 2
    assert {d.split("`")[3] for d in plan["diagnostics"]} == {"ConvRMSNorm", "RMSNorm"}
    assert plan["root_class"] == (
        "vibevoice.modular.modeling_vibevoice_inference.VibeVoiceForConditionalGenerationInference"
    )
    assert plan["modules"]["relocate"]["Block1D"] == 78  # layer-scale gammas
    assert plan["modules"]["stream:conv_rms_norm"] == {"ConvRMSNorm": 156}
    assert plan == snapshot


def test_community_norms_stream_bit_identically(report):
    assert report["norm_parity"] and all(report["norm_parity"].values()), report["norm_parity"]


def test_community_acoustic_tokenizer_round_trip_is_identical_when_streamed(report):
    assert report["tokenizer_round_trip"] == {"RMSNorm": True, "LN": True}
