"""The planner installs without torch: a wheel of this tree in a fresh venv that has no torch.

The venv is made from the interpreter this one was made from, without its site-packages and
without pip (the wheel goes in with this venv's pip, ``--python``, offline, ``--no-deps``). The
wheel's own metadata is checked to require torch only through the ``train`` extra, so a plain
``pip install .`` resolves without it; of the base dependencies only plotly (and what it imports)
is made visible to the venv, through a .pth file, because ``zerodp ui`` serves its plotly.js.
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchfree")
    wheel_dir = tmp / "wheel"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(wheel_dir), str(ROOT)])
    assert built.returncode == 0, built.stderr
    (wheel,) = wheel_dir.glob("zerodp-*.whl")
    base = getattr(sys, "_base_executable", None) or sys.executable
    env_dir = tmp / "venv"
    made = _run([base, "-m", "venv", "--without-pip", str(env_dir)])
    assert made.returncode == 0, made.stderr
    py = env_dir / "bin" / "python"
    has_torch = _run([str(py), "-c", "import torch"])
    assert has_torch.returncode != 0, "the fresh venv sees a torch: this test would prove nothing"
    inst = _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                 "--no-index", str(wheel)])
    assert inst.returncode == 0, inst.stderr
    # plotly and what it imports, from this venv, and nothing else
    import importlib
    import importlib.metadata

    links = tmp / "deps"
    links.mkdir()
    for dist in ("plotly", "narwhals", "packaging"):
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        tops = {f.parts[0] for f in files if len(f.parts) > 1 and f.parts[0] != ".."}
        for name in sorted(tops):  # the packages and their .dist-info (plotly reads its version)
            (links / name).symlink_to(Path(importlib.metadata.distribution(dist).locate_file(name)))
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(site, "zerodp-test-deps.pth").write_text(str(links) + "\n")
    return {"bin": env_dir / "bin", "py": py, "wheel": wheel}


def test_wheel_requires_torch_only_through_the_train_extra(venv):
    out = _run([str(venv["py"]), "-c",
                "import importlib.metadata as m, json; print(json.dumps(m.requires('zerodp')))"])
    requires = json.loads(out.stdout)
    torch_reqs = [r for r in requires if re.match(r"torch\b", r)]
    assert torch_reqs and all('extra == "train"' in r for r in torch_reqs), requires
    base = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith(("torch", "numpy", "safetensors")) for r in base), base


def test_plan_and_import_work_without_torch(venv):
    out = _run([str(venv["bin"] / "zerodp"), "plan", "memory", "--config",
                str(DATA / "llama-3-8b" / "config.json"), "--gpus", "8", "--json"])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["params"] == pytest.approx(8.03e9, rel=0.005)
    imp = _run([str(venv["py"]), "-c", "import sys, zerodp.plan; "
                "print('torch' in sys.modules, zerodp.plan.get_model('llama3-8b').params)"])
    assert imp.returncode == 0, imp.stderr
    assert imp.stdout.split()[0] == "False"


def test_train_names_the_extra(venv, tmp_path):
    # (sample of a path that does not exist says so first, before anything needs torch)
    for argv in (["train", "--steps", "1"], ["sample", str(tmp_path)]):
        out = _run([str(venv["bin"] / "zerodp"), *argv])
        assert out.returncode == 2, out.stderr
        err = out.stderr.strip()
        assert "zerodp[train]" in err and "\n" not in err and "Traceback" not in err, err


def test_ui_serves_without_torch(venv):
    proc = subprocess.Popen([str(venv["bin"] / "zerodp"), "ui", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"(http://\S+/)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = m.group(1)
        deadline = time.time() + 10
        while True:
            try:
                with urllib.request.urlopen(url + "api/memory?model=llama3-8b&n=8", timeout=5) as r:
                    body = json.loads(r.read())
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        assert body["model"]["name"] == "llama3-8b"
        with urllib.request.urlopen(url + "plotly.min.js", timeout=5) as r:
            assert r.status == 200 and len(r.read()) > 1_000_000
    finally:
        proc.terminate()
        proc.wait(timeout=10)
