"""Signature and layout variants for what this CPU machine cannot reproduce (CUDA, NCCL, NFS).

These lines are written in the shapes that PyTorch, NCCL, SLURM and mpirun print (as seen in
public bug reports); they test general signatures and ingest layouts, not one fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptguard.diagnose.engine import diagnose


def run(tmp_path: Path, text: str, name: str = "job.log"):
    p = tmp_path / name
    p.write_text(text)
    return diagnose([str(p)])


CUDA_OOM = (
    "[rank5]: Traceback (most recent call last):\n"
    '[rank5]:   File "train.py", line 90, in <module>\n'
    "[rank5]:     loss.backward()\n"
    "[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
    "GPU 5 has a total capacity of 79.15 GiB of which 1.2 GiB is free.\n"
    "[rank2]:[E1102 10:01:05.123456 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
    "ran for 600012 milliseconds before timing out.\n"
    "[rank3]:[E1102 10:01:05.223456 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
    "ran for 600010 milliseconds before timing out.\n"
)


def test_cuda_oom_with_watchdog_collateral(tmp_path: Path) -> None:
    d = run(tmp_path, CUDA_OOM)
    assert (d.failure_class, d.initiating_rank, d.collateral_ranks) == ("cuda_oom", 5, [2, 3])


# KB classes that the users' labels file under another class (their family)
FAMILY = {"ddp_unused_parameters": "python_exception", "config_error": "python_exception"}


@pytest.mark.parametrize(
    "line,cls",
    [
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda_illegal_memory_access"),
        ("RuntimeError: CUDA error: device-side assert triggered", "cuda_device_side_assert"),
        ("OSError: [Errno 116] Stale file handle: '/nfs/ckpt/step100'", "stale_nfs_handle"),
        (
            "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error "
            "(run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
            "nccl_network_error",
        ),
        ("OSError: [Errno 28] No space left on device: '/ckpt/step5/optim.pt'", "disk_full_enospc"),
        (
            "_pickle.UnpicklingError: Weights only load failed. "
            "Re-running `torch.load` with `weights_only` set to `False` will likely succeed",
            "unsafe_weights_only_load",
        ),
        (
            'RuntimeError: Error(s) in loading state_dict for GPT: Missing key(s) in state_dict: "lm_head.weight".',
            "state_dict_mismatch",
        ),
        (
            "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.",
            "ddp_unused_parameters",
        ),
        (
            "RuntimeError: Detected mismatch between collectives on ranks. "
            "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=3, OpType=BROADCAST)",
            "collective_mismatch_desync",
        ),
        ("OSError: [Errno 24] Too many open files", "too_many_open_files"),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "gpu_hardware_fault"),
        (
            "ValueError: Error initializing torch.distributed using env:// rendezvous: "
            "environment variable RANK expected, but not set",
            "config_error",
        ),
        (
            "FileExistsError: [Errno 17] File exists: '/shared/ckpt/global_step100/offloaded_tensors'",
            "checkpoint_write_race",
        ),
        (
            "OSError: [Errno 39] Directory not empty: '/mnt/ckpt/step200-tmp' -> '/mnt/ckpt/step200'",
            "checkpoint_write_race",
        ),
        (
            "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory",
            "checkpoint_corrupt_load",
        ),
    ],
)
def test_exception_signatures(tmp_path: Path, line: str, cls: str) -> None:
    text = (
        f'[rank1]: Traceback (most recent call last):\n[rank1]:   File "t.py", line 1, in <module>\n[rank1]: {line}\n'
    )
    text += "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:4321\n"
    d = run(tmp_path, text)
    assert (d.kind, d.failure_class, d.initiating_rank, d.collateral_ranks) == (cls, FAMILY.get(cls, cls), 1, [0])


def test_timestamps_order_ranks(tmp_path: Path) -> None:
    """Two ranks fail for different reasons: the earlier timestamp wins, not the earlier line."""
    text = (
        "[rank4]: 2024-03-01 12:00:09,000 ERROR RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "[rank6]: 2024-03-01 12:00:02,500 ERROR torch.OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 20.00 MiB\n"
        "[rank1]: 2024-03-01 12:00:10,000 ERROR RuntimeError: Connection reset by peer\n"
    )
    d = run(tmp_path, text)
    assert (d.failure_class, d.initiating_rank, d.collateral_ranks) == ("cuda_oom", 6, [1])
    assert d.also_failed_ranks == [4]
    assert d.ordering_basis.startswith("timestamps")
    assert any(a.failure_class == "cuda_illegal_memory_access" for a in d.alternatives)


def test_srun_label_and_slurm_oom(tmp_path: Path) -> None:
    text = (
        "0: step 10 loss 2.1\n"
        "3: step 10 loss 2.1\n"
        "slurmstepd: error: Detected 1 oom_kill event in StepId=4242.0. "
        "Some of your processes may have been killed by the cgroup out-of-memory handler.\n"
        "srun: error: gpu-node-07: task 3: Out Of Memory\n"
        "0: RuntimeError: [../gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.1.1.7]:2034\n"
        "srun: error: gpu-node-01: task 0: Exited with exit code 1\n"
    )
    d = run(tmp_path, text)
    assert d.failure_class == "host_oom_sigkill"
    assert d.initiating_rank == 3 or d.initiating_rank is None
    assert 0 in d.collateral_ranks


def test_mpirun_prefix(tmp_path: Path) -> None:
    text = (
        "[1,0]<stdout>:epoch 1 step 5\n"
        "[1,2]<stderr>:Traceback (most recent call last):\n"
        '[1,2]<stderr>:  File "train.py", line 3, in <module>\n'
        "[1,2]<stderr>:ModuleNotFoundError: No module named 'apex'\n"
        "[1,1]<stderr>:RuntimeError: Connection reset by peer\n"
    )
    d = run(tmp_path, text)
    assert (d.failure_class, d.kind, d.initiating_rank, d.collateral_ranks) == (
        "python_exception",
        "import_error",
        2,
        [1],
    )
    assert d.verify_command == 'python -c "import apex"'


def test_nccl_pid_map_attributes_launcher_kill(tmp_path: Path) -> None:
    """torchrun names only a pid; NCCL's init lines map that pid to its global rank."""
    text = (
        "node-b:4001:4101 [0] NCCL INFO comm 0x55 rank 8 nranks 16 cudaDev 0 busId 1000 - Init COMPLETE\n"
        "node-b:4002:4102 [1] NCCL INFO comm 0x56 rank 9 nranks 16 cudaDev 1 busId 2000 - Init COMPLETE\n"
        "node-b:4002:4102 [1] NCCL INFO Channel 00/1 : 9[1] -> 0[0] [send] via NET/Socket/0\n"
        "E0301 12:00:03.000000 4000 torch/distributed/elastic/multiprocessing/api.py:869] "
        "failed (exitcode: -9) local_rank: 1 (pid: 4002) of binary: /usr/bin/python\n"
        "W0301 12:00:02.000000 4000 torch/distributed/elastic/multiprocessing/api.py:897] "
        "Sending process 4001 closing signal SIGTERM\n"
    )
    d = run(tmp_path, text)
    assert (d.failure_class, d.initiating_rank, d.collateral_ranks) == ("host_oom_sigkill", 9, [8])
    assert d.world_size == 16
    assert d.initiating_host == "node-b"


def test_per_rank_files_by_name(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_0.log").write_text("RuntimeError: Connection closed by peer [1.2.3.4]:5\n")
    (tmp_path / "logs" / "rank_1.log").write_text(
        'Traceback (most recent call last):\n  File "x.py", line 2, in f\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB\n"
    )
    (tmp_path / "logs" / "slurm-991.out").write_text("srun: Job step aborted\n")
    d = diagnose([str(tmp_path / "logs")])
    assert (d.failure_class, d.initiating_rank, d.collateral_ranks) == ("cuda_oom", 1, [0])


def test_only_timeouts_without_a_silent_rank_says_unknown(tmp_path: Path) -> None:
    text = "".join(
        f"[rank{r}]:[E1102 10:01:05.1 ProcessGroupNCCL.cpp:616] [Rank {r}] "
        "Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n"
        for r in range(4)
    )
    d = run(tmp_path, text)
    assert d.failure_class == "nccl_watchdog_timeout"
    assert d.initiating_rank is None
    assert "not shown" in d.rank_attribution
    assert d.collateral_ranks == [0, 1, 2, 3]
    assert d.confidence < 0.5


@pytest.mark.parametrize(
    "text",
    [
        "[2024-05-01 10:00:02,001] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
        "(exitcode: 1) local_rank: 2 (pid: 4711) of binary: /usr/bin/python3\n",
        "Traceback (most recent call last):\n"
        '  File "/opt/venv/lib/python3.10/site-packages/torch/multiprocessing/spawn.py", line 158, in join\n'
        "    raise ProcessRaisedException(msg, error_index, failed_process.pid)\n"
        "torch.multiprocessing.spawn.ProcessRaisedException: \n\n"
        "-- Process 2 terminated with the following error:\n"
        "Traceback (most recent call last):\n",
    ],
    ids=["torchrun_exit_code", "spawn_cut_after_header"],
)
def test_an_exit_without_the_process_own_exception_is_not_quoted_as_one(tmp_path: Path, text: str) -> None:
    """Only the launcher's report of an exit: the root cause says what the log does not show
    instead of quoting the launcher's words as the process's exception."""
    d = run(tmp_path, text)
    assert (d.failure_class, d.initiating_rank) == ("python_exception", 2)
    assert "raised" not in d.root_cause and "none of its own output" in d.root_cause, d.root_cause


def test_verify_command_names_the_announced_checkpoint(tmp_path: Path) -> None:
    """The failing line names no path, an earlier line announced the save: the command to check
    the fix is filled with that checkpoint's directory rather than a placeholder."""
    d = run(
        tmp_path,
        "2024-02-01 10:00:00 INFO Saving checkpoint to /mnt/runs/exp7/checkpoint-3000\n"
        "Traceback (most recent call last):\n"
        '  File "/opt/app/train.py", line 40, in save\n'
        "    torch.save(state, path)\n"
        "OSError: [Errno 28] No space left on device\n",
    )
    assert d.failure_class == "disk_full_enospc"
    assert "/mnt/runs/exp7/checkpoint-3000" in d.verify_command, d.verify_command


def test_a_word_of_the_sentence_is_not_the_announced_path(tmp_path: Path) -> None:
    """`Saving checkpoint to PATH` by two ranks, each its own path: not one path written by two
    ranks (the announcement's `to` was read as the path), so the disk-full error stays itself."""
    d = run(
        tmp_path,
        "[rank0]: Saving checkpoint to /scratch/node0/ckpt/step_100.pt\n"
        "[rank1]: Saving checkpoint to /scratch/node1/ckpt/step_100.pt\n"
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/opt/app/train.py", line 88, in save\n'
        "[rank1]:     torch.save(state, path)\n"
        "[rank1]: OSError: [Errno 28] No space left on device\n",
    )
    assert (d.failure_class, d.initiating_rank) == ("disk_full_enospc", 1), d.rank_attribution
    assert "/scratch/node1/ckpt" in d.verify_command, d.verify_command
