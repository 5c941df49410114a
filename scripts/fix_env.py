"""Remove the packages of scripts/cpu_excludes.txt when they fail to import beside the installed torch.

`make venv` leaves them out when uv installs; pip (its fallback) cannot, so this removes what pip brought. PyPI's
builds of these link against CUDA torch; beside the CPU torch they fail at import, and transformers (imported by
vLLM) then fails too. Text models need none of them.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

EXCLUDES = Path(__file__).with_name("cpu_excludes.txt")


def imports_cleanly(module: str) -> bool:
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return result.returncode == 0


def main() -> None:
    names = [line.strip() for line in EXCLUDES.read_text().splitlines() if line.strip() and line[0] != "#"]
    broken = [name for name in names if importlib.util.find_spec(name) is not None and not imports_cleanly(name)]
    if broken:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *broken], check=True)
        print(f"fix_env: removed {', '.join(broken)}: they fail to import beside this torch (text models do not "
              "need them)")


if __name__ == "__main__":
    main()
