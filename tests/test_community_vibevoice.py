"""The shipped `vibevoice` policy on the original community implementation (PyPI `vibevoice` 0.0.1).

That package pins transformers 4.51.3 and registers configs named like transformers 5's own
VibeVoice, so it cannot share a process with the rest of the suite. The test builds a separate
virtual environment (cached between runs) that sees this environment's torch and streamwise
through `--system-site-packages` but holds its own transformers, and runs
tests/community/check_community.py there.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from helpers import TESTS

REQUIREMENTS = ["transformers==4.51.3", "diffusers==0.35.2"]
NO_DEPS = ["vibevoice==0.0.1", "accelerate==1.6.0"]  # the package's own pins; its app extras are not needed


def community_python() -> Path:
    key = hashlib.sha256(" ".join([sys.version, *REQUIREMENTS, *NO_DEPS]).encode()).hexdigest()[:12]
    root = Path(os.environ.get("STREAMWISE_CACHE", Path.home() / ".cache" / "streamwise")) / f"community-vibevoice-{key}"
    python = root / "bin" / "python"
    if not (root / "ready").exists():
        venv.EnvBuilder(system_site_packages=True, clear=True, with_pip=True).create(root)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, *REQUIREMENTS], check=True)
        subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
        (root / "ready").touch()
    return python


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STREAMWISE_POLICY_PATH")}
    result = subprocess.run(
        [str(community_python()), str(TESTS / "community" / "check_community.py")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_full_size_community_model_is_covered_completely(report, snapshot):
    plan = report["plan"]
    assert plan["complete"] and plan["stranded"] == [] and plan["diagnostics"] == []
    assert plan["root_class"] == "vibevoice.modular.modeling_vibevoice_inference.VibeVoiceForConditionalGenerationInference"
    assert plan["modules"]["relocate"]["Block1D"] == 78  # layer-scale gammas
    assert plan["modules"]["stream:conv_rms_norm"] == {"ConvRMSNorm": 156}
    assert plan == snapshot


def test_community_norms_stream_bit_identically(report):
    assert report["norm_parity"] and all(report["norm_parity"].values()), report["norm_parity"]


def test_community_acoustic_tokenizer_round_trip_is_identical_when_streamed(report):
    assert report["tokenizer_round_trip"] == {"RMSNorm": True, "LN": True}
