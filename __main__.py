"""The commands without an install: `python -m streamwise ...` where the package is installed, or
`python path/to/custom_nodes/<this pack> ...` in a ComfyUI checkout (the pack's folder, run as a script).

The arguments are those of the `streamwise` command (`demo`, `example-models DIR`, `quantize`, `policy draft`);
`policy-validate ...` as the first argument runs that command instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def _as_streamwise() -> None:
    """Import this folder as the package `streamwise` when it was run as a folder (`python <pack>`), so the commands'
    relative imports resolve; its own folder leaves `sys.path`, where its subfolders could shadow other modules."""
    if __package__:
        return  # `python -m streamwise`: the package is imported already
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    spec = importlib.util.spec_from_file_location(
        "streamwise", os.path.join(here, "__init__.py"), submodule_search_locations=[here])
    module = sys.modules["streamwise"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def main(argv: list[str]) -> int:
    _as_streamwise()
    if argv[:1] == ["policy-validate"]:
        return importlib.import_module("streamwise.runtime.cli.policy_validate").main(argv[1:])
    return importlib.import_module("streamwise.runtime.cli.streamwise").main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
