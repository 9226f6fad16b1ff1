"""`dualframe doctor` against the real installation, and against an interpreter that lacks everything."""
import json
import pathlib
import subprocess
import sys
import venv

from dualframe.launch import doctor

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_doctor_json_reports_a_usable_install():
    result = subprocess.run([sys.executable, "-m", "dualframe", "doctor", "--json", "--require", "torch",
                             "--require", "tensorflow"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["usable"] and report["problems"] == []
    for framework in ("torch", "tensorflow"):
        assert report[framework]["horovod"] == "0.28.1"
        assert report[framework]["build"]["mpi"] and report[framework]["build"]["gloo"]
    assert report["torch"]["version"].startswith("2.13.0")
    assert report["tensorflow"]["version"].startswith("2.21") and report["tensorflow"]["keras"].startswith("3.")
    assert "Open MPI" in report["mpi"]["mpirun"]["version"]
    assert report["topology"]["launcher"] == "none" and report["topology"]["size"] == 1
    assert report["horovodrun"] and report["horovodrun"].endswith("horovodrun")


def test_doctor_text_report():
    result = subprocess.run([sys.executable, "-m", "dualframe", "doctor"], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usable: yes" in result.stdout and "built with: mpi, gloo" in result.stdout


def test_doctor_names_what_is_missing_and_the_fix(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    report = doctor.gather(python=str(bare / "bin" / "python"))
    issues = doctor.problems(report, required=("torch",))
    assert not report["torch"]["ok"] and "No module named 'torch'" in report["torch"]["error"]
    assert any("no framework works with Horovod" in p and doctor.FIX in p for p in issues)
    assert any(p.startswith("torch with Horovod is required") for p in issues)
    assert "PROBLEM:" in doctor.render(report, issues)
