"""The MPS v3 command grammar and output parsers against outputs captured on driver 615.

The captured outputs are those NVIDIA's GPU Fractioning Operator pinned verbatim in its tests
(kai-scheduler/gpu-fractioning, ``fractioning-manager/mpsd/internal/mpsctl/control_test.go`` at 1cb2b23,
``TestParsePIDsRejectsTheTruncatedTableFormat``): the same two clients as ``client list`` prints them in
its default table form (PIDs cut to ``316...``) and with ``--format=csv,noheader``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.node.mps.control import (
    MAX_PID,
    MpsCommandError,
    MpsControl,
    parse_client_list,
    parse_namespace_list,
    parse_pipe_directory,
)
from gpufrac.node.mps.mode import MpsMode
from gpufrac.node.mps.names import (
    MAX_PIPE_DIR_BYTES,
    PipeDirTooLong,
    check_pipe_dir,
    is_managed,
    namespace_name,
    valid_namespace_name,
)

R615_CLIENT_LIST_TABLE = (
    "PID     SERVER        DEVICE                                         MAWS NS                   CMD\n"
    "316...  srv           GPU-cc97390c-c189-71f5-1bb7-5b0af481fa0d       srv/default (0)           "
    "VLLM::EngineCore\n"
    "316...  srv           GPU-cc97390c-c189-71f5-1bb7-5b0af481fa0d       srv/default (0)           "
    "VLLM::EngineCore\n"
)
R615_CLIENT_LIST_CSV = (
    "3167082,srv,GPU-cc97390c-c189-71f5-1bb7-5b0af481fa0d,srv/default (0),VLLM::EngineCore\n"
    "3165259,srv,GPU-cc97390c-c189-71f5-1bb7-5b0af481fa0d,srv/default (0),VLLM::EngineCore\n"
)


def test_client_list_csv_of_615_gives_every_client_with_its_full_pid_and_namespace() -> None:
    clients = parse_client_list(R615_CLIENT_LIST_CSV)
    assert [(c.pid, c.server, c.namespace) for c in clients] == [
        (3167082, "srv", "default"),
        (3165259, "srv", "default"),
    ]


def test_the_truncated_table_of_615_is_never_read_as_pids() -> None:
    # Parsed by digits, `316...` is 316: a PID of nobody's, so a drain would terminate nothing, silently.
    assert parse_client_list(R615_CLIENT_LIST_TABLE) == []


@pytest.mark.parametrize(
    ("text", "pids"),
    [
        ("", []),
        ("0,srv,GPU-1,srv/default (0),x\n42,srv,GPU-1,srv/default (0),x\n", [42]),  # 0 is no PID
        ("-5,srv\n", []),
        (f"{MAX_PID},srv\n{MAX_PID + 1},srv\n", [MAX_PID]),
        ("77,srv\n12,srv\n77,srv\n", [77, 12]),  # a duplicate would be terminated twice: a false wedge
        ("abc123,srv\n12.5,srv\n", []),
        ("9,srv,GPU-12345678-1234,srv/ns_1 (4),cuda 99\n", [9]),  # digits elsewhere are no PIDs
    ],
)
def test_client_list_takes_the_pid_from_the_whole_first_field_only(text: str, pids: list[int]) -> None:
    assert [c.pid for c in parse_client_list(text)] == pids


def test_namespace_list_reads_names_from_the_table_and_nothing_else() -> None:
    table = (
        "NAME                                      ID   ACTIVE THREAD %  PINNED MEM  CLIENTS\n"
        "default                                   0    1                1M          0\n"
        "gpufrac_aaaaaaaaaaaa_0123456789abcdef0123 1    50               4096M       1\n"
        "gpufrac_bbbbbbbbbbbb_01...                2    25               N/A         0\n"
        "shared/ns_x (3)                           3    10               N/A         0\n"
        "\n"
    )
    # The header is no name; a truncated name is not mistaken for another (nor ever deleted).
    assert parse_namespace_list(table) == ["default", "gpufrac_aaaaaaaaaaaa_0123456789abcdef0123", "ns_x"]


@pytest.mark.parametrize(
    "text",
    [
        "/run/nvidia/mps/shared/ns_a\n",
        "pipe_directory=/run/nvidia/mps/shared/ns_a",
        "pipe_directory: /run/nvidia/mps/shared/ns_a/\n",
        '"/run/nvidia/mps/shared/ns_a"',
        "Querying namespace ns_a\n/run/nvidia/mps/shared/ns_a\nmps-control>",
    ],
)
def test_pipe_directory_is_the_first_absolute_path_of_the_answer(text: str) -> None:
    assert parse_pipe_directory(text) == Path("/run/nvidia/mps/shared/ns_a")


@pytest.mark.parametrize("text", ["", "Error: no namespace 'ns_a'\n", "shared/ns_a\n"])
def test_an_answer_without_an_absolute_path_is_no_pipe_directory(text: str) -> None:
    assert parse_pipe_directory(text) is None


@pytest.mark.parametrize(
    "container_id",
    [
        "a" * 64,  # containerd / CRI-O
        "3F2A-b_c.d/e",  # anything else the runtime might hand over
        "x",
    ],
)
def test_a_containers_namespace_name_is_one_the_daemon_accepts(container_id: str) -> None:
    name = namespace_name(container_id)
    assert valid_namespace_name(name) and is_managed(name)
    assert name == namespace_name(container_id)  # the same after an agent restart (Synchronize)
    assert len(name) <= 41  # short enough for the socket path (names.MAX_PIPE_DIR_BYTES)


def test_namespace_names_never_collide_where_the_readable_part_does() -> None:
    # Same first 12 characters, same sanitised text: the digest of the whole id keeps them apart.
    ids = ["a" * 12 + "0" * 52, "a" * 12 + "1" * 52, "AAAAAAAAAAAA" + "0" * 52, "aaaaaaaaaaa-" + "0" * 52]
    names = {namespace_name(i) for i in ids}
    assert len(names) == len(ids)
    assert {n[: len("gpufrac_") + 12] for n in names} <= {"gpufrac_aaaaaaaaaaaa", "gpufrac_aaaaaaaaaaa_"}


def test_the_old_names_and_foreign_names_are_not_valid_or_not_ours() -> None:
    assert not valid_namespace_name("ctr-" + "a" * 20)  # what the seed created: refused on 615
    assert not valid_namespace_name("Ns") and not valid_namespace_name("")
    assert not is_managed("default") and not is_managed("someone_elses")
    with pytest.raises(ValueError, match="container id"):
        namespace_name("  ")


def test_a_pipe_directory_too_long_for_its_socket_is_refused_with_its_path_and_the_limit() -> None:
    check_pipe_dir("/" + "d" * (MAX_PIPE_DIR_BYTES - 1))
    too_long = "/" + "d" * MAX_PIPE_DIR_BYTES
    with pytest.raises(PipeDirTooLong) as refused:
        check_pipe_dir(too_long)
    message = str(refused.value)
    assert too_long in message and f"{MAX_PIPE_DIR_BYTES}-byte limit" in message and "108 bytes" in message


def control(mode: MpsMode = MpsMode.V3) -> MpsControl:
    return MpsControl(
        control_bin="/nonexistent/nvidia-cuda-mps-control",
        pipe_dir=Path("/run/nvidia/mps"),
        log_dir=Path("/var/log/nvidia-mps"),
        mode=mode,
        timeout_s=1.0,
    )


def test_v3_commands_are_argv_after_dash_p_3_classic_ones_a_line_on_stdin() -> None:
    assert control().invocation("client", "list", "--format=csv,noheader") == (
        ["/nonexistent/nvidia-cuda-mps-control", "-p", "3", "client", "list", "--format=csv,noheader"],
        None,
    )
    assert control(MpsMode.CLASSIC).invocation("get_client_list", "42") == (
        ["/nonexistent/nvidia-cuda-mps-control"],
        b"get_client_list 42\n",
    )


async def test_a_name_the_daemon_would_refuse_never_reaches_it() -> None:
    # The binary does not exist: had the command run, the error would say it cannot be run.
    for call in (
        control().create_namespace(server="shared", name="ctr-1a2b"),
        control().delete_namespace(server="shared", name="Ns"),
        control().namespace_pipe_directory(server="shared", name="a/b"),
    ):
        with pytest.raises(MpsCommandError, match=r"does not match \[a-z0-9_\]\+"):
            await call
    with pytest.raises(MpsCommandError, match=r"active_thread_percentage 0 .* not in \[1, 100\]"):
        await control().set_namespace(
            server="shared", name="ns_a", active_thread_percentage=0, pinned_memory_limit=None
        )
