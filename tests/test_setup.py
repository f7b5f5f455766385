"""The README's set-up where the system Python refuses `pip install` outside a virtual environment (PEP 668,
as on current Debian and Ubuntu): the two commands make and use a .venv of the checkout's own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_setup_and_serve_make_and_use_a_venv_when_the_system_python_refuses_pip(tmp_path):
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / "python3"
    shim.write_text(
        "#!/bin/bash\n"
        "# python3 as on a PEP 668 system: pip refuses to install outside a virtual environment.\n"
        'if [ "$1 $2 $3" = "-m pip install" ] && [ -z "$VIRTUAL_ENV" ]; then\n'
        '    echo "error: externally-managed-environment" >&2; exit 1\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    env["PATH"] = f"{shims}:{env['PATH']}"
    setup = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=1500)
    assert setup.returncode == 0, setup.stderr[-3000:]
    assert "making one in" in setup.stderr
    assert "did not build" not in setup.stderr  # the kernels compile while pip installs the rest, from torch alone
    venv_python = checkout / ".venv" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import pagedserve, torch; print(pagedserve.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert where.returncode == 0 and where.stdout.strip().startswith(str(checkout)), where.stderr
    serve = subprocess.run(["bash", "scripts/serve.sh", "--help"], cwd=checkout, env=env, capture_output=True, text=True,
                           timeout=900)
    assert serve.returncode == 0 and "--max-num-seqs" in serve.stdout, serve.stderr[-3000:]
