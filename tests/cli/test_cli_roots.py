"""A newcomer's first commands: `ls`/`verify` on the directories frameworks write, URL typos, a missing
extra, and no traceback for a user error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptguard import Checkpointer, UnsupportedStorageError
from ckptguard.discover import FoundRoot, find_roots

NO_BOTO = "import sys; sys.modules['boto3'] = sys.modules['botocore'] = None\n"


def cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = (
        prelude + "import sys, runpy; sys.argv = ['ckptguard', *sys.argv[1:]]; runpy.run_module('ckptguard', "
        "run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def _root(path: Path, steps: tuple[int, ...], metadata: dict[str, object] | None = None) -> Path:
    with Checkpointer(path, process_group="local") as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((4,), float(s))}, metadata=metadata)
    return path


def test_ls_and_verify_find_every_framework_root_inside_a_directory(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _root(runs / "hf-out" / ".ckptguard-hf", (5, 10), {"folder": "checkpoint-10", "global_step": 10})
    _root(runs / "lightning" / ".ckptguard-lightning", (0,), {"global_step": 8, "epoch": 3})
    _root(runs / "titan" / "checkpoint", (20,), {"torchtitan": {"model_only": False}, "framework": "torchtitan"})
    (runs / "hf-out" / "checkpoint-10").mkdir()  # the framework's own files beside the root
    (runs / "notes").mkdir()
    assert find_roots(runs / "hf-out") == [FoundRoot(str(runs / "hf-out" / ".ckptguard-hf"), "transformers")]
    assert [(os.path.relpath(r.path, runs), r.framework) for r in find_roots(runs)] == [
        ("hf-out/.ckptguard-hf", "transformers"),
        ("lightning/.ckptguard-lightning", "lightning"),
        ("titan/checkpoint", "torchtitan"),
    ]

    out = cli("ls", str(runs / "hf-out"))
    assert out.returncode == 0, out.stderr
    assert ".ckptguard-hf (written by the transformers integration)" in out.stdout
    assert '"global_step": 10' in out.stdout and "latest" in out.stdout
    every = cli("verify", str(runs), "--json")
    assert every.returncode == 0, every.stderr
    doc = json.loads(every.stdout)
    assert doc["intact"] is True and [(r["framework"], r["safe_to_resume"]) for r in doc["roots"]] == [
        ("transformers", 10),
        ("lightning", 0),
        ("torchtitan", 20),
    ]
    # A root given itself keeps the single-root document (plus its framework).
    single = json.loads(cli("ls", str(runs / "titan" / "checkpoint"), "--json").stdout)
    assert single["framework"] == "torchtitan" and [c["step"] for c in single["checkpoints"]] == [20]

    # One damaged root among several: exit 1, and the others still reported intact.
    data = next((runs / "lightning" / ".ckptguard-lightning" / "step-00000000" / "data").iterdir())
    data.write_bytes(b"\xff" * data.stat().st_size)
    damaged = cli("verify", str(runs))
    assert damaged.returncode == 1 and damaged.stdout.count("NOT INTACT") == 1
    assert damaged.stdout.count("│ intact ") == 3


def test_a_directory_without_any_root_is_exit_3_and_an_empty_root_is_exit_0(tmp_path: Path) -> None:
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    (tmp_path / "plain" / "latest").write_text("global_step5")  # DeepSpeed's own pointer is not a root
    for cmd in ("ls", "verify"):
        out = cli(cmd, str(tmp_path / "plain"))
        assert out.returncode == 3, (cmd, out.stdout, out.stderr)
        assert "holds no ckptguard checkpoint root" in out.stderr and "Traceback" not in out.stderr
    Checkpointer(tmp_path / "fresh", process_group="local").close()  # opened, nothing saved yet
    out = cli("verify", str(tmp_path / "fresh"))
    assert out.returncode == 0 and "no committed checkpoint" in out.stdout


@pytest.mark.parametrize(
    "typo,meant",
    [("s3:/bucket/run", "s3://bucket/run"), ("s3:bucket", "s3://bucket"), ("S3:/bucket/run", "s3://bucket/run")],
)
def test_a_malformed_url_is_refused_with_what_was_meant_and_nothing_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, typo: str, meant: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match=f"did you mean {meant}"):
        Checkpointer(typo)
    out = cli("verify", typo)
    assert out.returncode == 2 and f"did you mean {meant}" in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(tmp_path) == []
    Checkpointer("run:3", process_group="local").close()  # a directory name with a colon stays a directory
    assert os.path.isdir(tmp_path / "run:3")


def test_a_missing_s3_extra_names_the_install_line_from_api_and_cli() -> None:
    api = subprocess.run(
        [
            sys.executable,
            "-c",
            NO_BOTO
            + (
                "import ckptguard\n"
                "for call in (lambda: ckptguard.Checkpointer('S3://bucket/run'), lambda: ckptguard.load_file('s3://b/m.pt')):\n"
                "    try:\n        call()\n"
                "    except ckptguard.CheckpointError as e:\n        print(type(e).__name__, e)\n"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert api.returncode == 0, api.stderr
    lines = api.stdout.splitlines()
    assert len(lines) == 2 and all("pip install 'ckptguard[s3]'" in x for x in lines), api.stdout
    assert all(x.startswith("UnsupportedStorageError S3://bucket/run") or "s3://b" in x for x in lines)
    out = cli("ls", "s3://bucket/run", prelude=NO_BOTO)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "pip install 'ckptguard[s3]'" in out.stderr
    debug = cli("--debug", "ls", "s3://bucket/run", prelude=NO_BOTO)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "UnsupportedStorageError" in debug.stderr


def test_an_error_a_command_does_not_handle_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    bad = cli("import", str(tmp_path / "src.pt"), str(tmp_path / "ck"), "--step", "-1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.count("\n") == 1 and "step must be a non-negative int, got -1" in bad.stderr
    debug = cli("--debug", "import", str(tmp_path / "src.pt"), str(tmp_path / "ck"), "--step", "-1")
    assert "Traceback" in debug.stderr and "ValueError" in debug.stderr
    assert debug.returncode == 2 and not (tmp_path / "ck").exists()


def test_debug_keeps_the_exit_code_and_prints_the_traceback(tmp_path: Path) -> None:
    Checkpointer(tmp_path / "r", process_group="local").close()
    for args in (
        ("verify", str(tmp_path / "missing")),
        ("ls", "gs://x"),
        ("verify", str(tmp_path / "r"), "--step", "77"),
        ("verify", str(tmp_path / "r"), "--bogus"),
    ):
        plain, debug = cli(*args), cli("--debug", *args)
        assert plain.returncode == debug.returncode == 2, (args, plain.stderr, debug.stderr)
        assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr, (args, debug.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ("verify", "", "--threads", "0"),
        ("verify", "", "--step", "abc"),
        ("verify", "", "--bogus"),
        ("import",),
        ("verify", "", "--json", "extra"),
    ],
)
def test_a_bad_option_is_one_line_on_stderr_and_exit_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = cli(*(str(tmp_path) if a == "" else a for a in args))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert "╭" not in out.stderr and out.stdout == ""


def test_refused_commands_create_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    _root(tmp_path / "r", (1,))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for args, says in (
        (("import", "plain.pt", "new", "--step", "-5"), "step must be a non-negative int"),
        (("import", "plain.pt", "file://host/x", "--step", "1"), "on host 'host'"),
        (("export", "r", "out.pt", "--to", "bogus"), "to must be one of"),
        (("export", "r", "out.pt", "--key", "nope"), "error: no 'nope' in the checkpoint"),
        (("ls", "file://"), "filesystem root"),
    ):
        out = cli(*args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (args, out.stderr)
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before, args


@pytest.mark.parametrize("root", ["", "file://", "file:///", "/", "file://host/x", "file://example.com/ckpts"])
def test_an_empty_root_filesystem_root_or_other_host_is_refused_by_api_and_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="nothing was created"):
        Checkpointer(root, process_group="local")
    out = cli("verify", root)
    assert out.returncode == 2 and "nothing was created" in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(tmp_path) == [] and not os.path.exists("/.ckptguard")


def test_a_tilde_root_is_the_home_directory_as_in_a_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with Checkpointer("~/ckpts", process_group="local") as ck:
        ck.save(1, {"w": torch.ones(2)})
    assert (tmp_path / "home" / "ckpts" / "step-00000001").is_dir() and not (tmp_path / "~").exists()
    with Checkpointer("file://localhost" + str(tmp_path / "home" / "ckpts"), process_group="local") as ck:
        assert ck.latest() == 1
    env_out = subprocess.run(
        [sys.executable, "-m", "ckptguard", "ls", "~/ckpts"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(tmp_path / "home")},
    )
    assert env_out.returncode == 0 and "step-00000001" in env_out.stdout, env_out.stderr


def test_an_unreadable_subdirectory_is_skipped_with_a_note(tmp_path: Path) -> None:
    _root(tmp_path / "run1", (1,))
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found").chmod(0)
    try:
        nocap = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
        for cmd in ("ls", "verify"):
            out = subprocess.run(
                [*nocap, sys.executable, "-m", "ckptguard", cmd, str(tmp_path)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, (cmd, out.stderr)
            assert f"skipped {tmp_path / 'lost+found'}: permission denied" in out.stderr and "run1" in out.stdout
    finally:
        (tmp_path / "lost+found").chmod(0o755)


@pytest.mark.parametrize(
    "integration,framework",
    [
        ("hf", "transformers"),
        ("accelerate", "accelerate"),
        ("deepspeed", "deepspeed"),
        ("lightning", "lightning"),
        ("torchtitan", "torchtitan"),
    ],
)
def test_an_integration_without_its_framework_names_the_install_line(integration: str, framework: str) -> None:
    code = (
        f"import sys; sys.modules[{framework!r}] = None\n"
        f"try:\n    import ckptguard.integrations.{integration}\n"
        "except ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ImportError "), (out.stdout, out.stderr)
    assert f"ckptguard.integrations.{integration} needs" in out.stdout
    assert f"pip install 'ckptguard[{framework}]'" in out.stdout


def test_verify_says_which_roots_lack_a_step_hints_at_the_root_and_json_always_has_intact(tmp_path: Path) -> None:
    _root(tmp_path / "runs" / "a", (1, 2))
    _root(tmp_path / "runs" / "b", (1,))
    out = cli("verify", str(tmp_path / "runs"), "--step", "2")
    assert out.returncode == 0, out.stderr
    assert f"step 2 is not a committed checkpoint in {tmp_path / 'runs' / 'b'}; committed: [1]" in out.stdout
    assert "no committed checkpoint to verify" not in out.stdout
    step_dir = cli("verify", str(tmp_path / "runs" / "a" / "step-00000001"))
    assert step_dir.returncode == 3
    assert f"ckptguard verify {tmp_path / 'runs' / 'a'} --step 1" in step_dir.stderr
    (tmp_path / "empty").mkdir()
    empty = cli("verify", str(tmp_path / "empty"), "--json")
    assert empty.returncode == 3 and json.loads(empty.stdout)["intact"] is False
