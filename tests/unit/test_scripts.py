"""The measurement scripts in scripts/ import the trainlib of their own
checkout: on the GPU machine trainlib is not installed (its torch cannot be
replaced; the source tree is used as is), and where some other trainlib is
installed a script must still measure the tree it sits in."""

import os
import re
import shutil
import subprocess
import sys

from tests.helpers import REPO

# guard_overhead.py takes trainlib from PYTHONPATH on purpose: it also measures older trees.
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name != "guard_overhead.py"
                 and re.search(r"^(from|import) trainlib\b", p.read_text(), re.M))


def test_scripts_import_the_trainlib_of_their_checkout(tmp_path):
    assert {"benchmark.py", "ac_memory.py", "cp_memory.py"} <= set(SCRIPTS)
    checkout = tmp_path / "checkout"
    (checkout / "trainlib").mkdir(parents=True)
    (checkout / "scripts").mkdir()
    # A stand-in package: importing it says so and stops the script there.
    (checkout / "trainlib" / "__init__.py").write_text("import sys\nprint('checkout trainlib')\nsys.exit(17)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name in SCRIPTS:
        shutil.copy(REPO / "scripts" / name, checkout / "scripts" / name)
        proc = subprocess.run([sys.executable, str(checkout / "scripts" / name), "--help"], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert (proc.returncode, proc.stdout.strip()) == (17, "checkout trainlib"), (name, proc.stderr[-2000:])
