"""A wheel built from the repo, installed in a fresh venv, runs `generate` on its default model,
verifies a shipped model by name and trains from a shipped config, from outside the checkout:
the shipped configs and models travel as package data, and the wheel installs one top-level
package, mbd_jax.

The fresh venv gets the wheel with --no-deps; its dependencies come from this test's own
environment through a path file (downloading jax again is not what is being tested)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_wheel_in_a_fresh_venv_generates_on_its_default_model(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("mbd_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"mbd_jax", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "mbd_jax/models/tiny-mbd/config.yaml" in names
    assert "mbd_jax/configs/serve.yaml" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    pathlib.Path(site, "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    where = subprocess.run([str(py), "-c", "import mbd_jax; print(mbd_jax.__file__)"], cwd=tmp_path,
                           env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(site), where  # the installed wheel, not the checkout
    r = subprocess.run([str(venv / "bin" / "mbd-jax"), "generate", "--prompt", "Sort: 3 1 2",
                        "--max-new-tokens", "8", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens"] > 0 and isinstance(out["text"], str)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "models").exists()
    # the shipped names resolve from the wheel: a model to verify, a training config to run
    mbd = lambda *args: subprocess.run([str(venv / "bin" / "mbd-jax"), *args], cwd=tmp_path,  # noqa: E731
                                       env=env, capture_output=True, text=True, timeout=600)
    r = mbd("verify", "tiny-mbd")
    assert r.returncode == 0 and "tiny-mbd: verified" in r.stdout, r.stdout + r.stderr
    r = mbd("train", "--config", "configs/train/tiny-mbd.yaml", "--steps", "1", "--set",
            "batch_size=2", "--set", "seq_len=64", "--set", "length_buckets=[]", "--output", "out",
            "--checkpoint-dir", "ckpt", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1])["model_dir"] == str(tmp_path / "out")
    assert '"step": 1' in r.stderr and (tmp_path / "ckpt").is_dir()
    assert mbd("verify", "out").returncode == 0  # a model directory the wheel wrote and checks
