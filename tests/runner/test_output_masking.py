"""Everything that leaves the process is masked: secrets planted in a job's command line, environment and
logs appear in no field of report.json, report.html, the --on-failure hook's CKPTGUARD_* variables,
`diagnose --json`, `diagnose --html` or the terminal report; the job's command line reaches the hook
through no variable and no argument."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckptguard.diagnose.mask import Masker

HF = "hf_" + "Q7wErTyUiOpAsDfGhJkLzXcVbNm1234567"
AWS_ID = "AKIA" + "J5QXUV2ZL7RW3XKT"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzKEYaaaa"
SHORT_PW = "Zq9"
TOKEN = "tokV4lue42"
URL_PW = "UrlPw77x"
ENV_SECRET = "EnvS3cretValue9"
LOG_PW = "L0gPassw0rd"
BEARER = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTYifQ.c2lnbmF0dXJlLXZhbHVl"
SECRETS = [HF, AWS_ID, AWS_SECRET, SHORT_PW, TOKEN, URL_PW, ENV_SECRET, LOG_PW, BEARER]

CHILD = f"""
import os, sys
print("step 10 loss 0.5", flush=True)
print("using key", os.environ["MY_SERVICE_TOKEN"], file=sys.stderr)
print("Authorization: Bearer {BEARER}", file=sys.stderr)
print("aws_secret_access_key={AWS_SECRET} for {AWS_ID}", file=sys.stderr)
print("argv:", " ".join(sys.argv[1:]), file=sys.stderr)
raise RuntimeError("login failed: password={LOG_PW} token " + os.environ["MY_SERVICE_TOKEN"] + " " + sys.argv[-1])
"""


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_secrets_in_command_line_environment_and_logs_leave_no_output(tmp_path: Path) -> None:
    logs, hook, hook_all = tmp_path / "logs", tmp_path / "hook.env", tmp_path / "hook-all.env"
    env = {**os.environ, "MY_SERVICE_TOKEN": ENV_SECRET, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        "-m",
        "ckptguard",
        "run",
        "--logs",
        str(logs),
        "--grace",
        "0",
        "--on-failure",
        f'env | grep ^CKPTGUARD_ > {hook}; env -0 > {hook_all}; printf \'%s\\0\' "$0" "$@" >> {hook_all}',
        "--",
        sys.executable,
        "-c",
        CHILD,
        f"--password={SHORT_PW}",
        "--token",
        TOKEN,
        f"https://alice:{URL_PW}@example.com/repo",
        "--hub-token",
        HF,
        AWS_ID,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    (report_json,) = logs.glob("*/report.json")
    report = json.loads(report_json.read_text())
    assert report["runs"][0]["command"][-5] == "<secret>"  # the value of --token: the next word
    assert report["found"] is True
    # The job's own output is passed through as it is; what the runner adds follows it.
    summary = res.stderr[res.stderr.index("ckptguard run: the command failed") :]
    outputs = {
        "report.json": _strings(report),
        "report.html": [next(logs.glob("*/report.html")).read_text()],
        "hook env": [hook.read_text()],
        "run summary": [summary],
    }
    diag_json = subprocess.run(
        [sys.executable, "-m", "ckptguard", "diagnose", str(logs), "--json", "--html", str(tmp_path / "d.html")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert diag_json.returncode == 0, diag_json.stderr
    outputs["diagnose --json"] = _strings(json.loads(diag_json.stdout))
    outputs["diagnose --html"] = [(tmp_path / "d.html").read_text()]
    stderr_log = next(logs.glob("*/stderr.log"))
    for args in ((str(logs),), (str(stderr_log), "--json")):
        out = subprocess.run(
            [sys.executable, "-m", "ckptguard", "diagnose", *args], env=env, capture_output=True, text=True, timeout=120
        )
        outputs[f"diagnose {' '.join(args[1:])}"] = [out.stdout, out.stderr]
    assert "<secret>" in json.dumps(report)
    leaks = {where: _leaks("\n".join(texts)) for where, texts in outputs.items()}
    assert leaks == {where: [] for where in outputs}, leaks
    # The hook's whole environment and its arguments: the runner's own environment (the user's, which
    # the job has too), what ckptguard adds (masked above), and what the shell sets; nothing of the
    # job's command line.
    words = hook_all.read_bytes().decode().split("\0")
    added = {w.split("=", 1)[0] for w in words if "=" in w} - set(env)
    assert added <= {"PWD", "OLDPWD", "SHLVL", "_"} | {k for k in added if k.startswith("CKPTGUARD_")}, added
    assert any(w.startswith("CKPTGUARD_REPORT_JSON=") for w in words)
    command_line = [HF, AWS_ID, SHORT_PW, TOKEN, URL_PW]
    assert [s for s in command_line if any(s in w for w in words)] == []


def test_masker_hides_command_line_forms_and_keeps_ordinary_options() -> None:
    m = Masker(env={"DB_PASSWORD": "dbpw-123456", "PATH": "/usr/bin", "HOME": "/root"})
    argv = [
        "train.py",
        "--password=x",
        "--token",
        "abc",
        "--tokenizer",
        "gpt2",
        "--api-key",
        "k1",
        "--lr=0.1",
        "--max_steps",
        "100",
        "s3://AKIAJ5QXUV2ZL7RW3XKT:pw@b/k",
        "--db",
        "dbpw-123456",
    ]
    assert m.mask_argv(argv) == [
        "train.py",
        "--password=<secret>",
        "--token",
        "<secret>",
        "--tokenizer",
        "gpt2",
        "--api-key",
        "<secret>",
        "--lr=0.1",
        "--max_steps",
        "100",
        "s3://<secret>:<secret>@b/k",
        "--db",
        "<secret>",
    ]
    assert (
        m.mask("python train.py --hf_token hf_x --output_dir /root/out")
        == "python train.py --hf_token <secret> --output_dir /root/out"
    )
