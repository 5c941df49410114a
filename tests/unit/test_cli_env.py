"""``dcp-triton env``: the kernels line names what an engine's attention layers would run in this process."""

import pytest

from dcp_plugin.cli import main


def env_lines(capsys) -> dict[str, str]:
    assert main(["env"]) == 0
    return dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())


def test_env_names_the_torch_references_as_the_cpu_default(capsys, monkeypatch):
    monkeypatch.delenv("DCP_TRITON_KERNELS", raising=False)
    lines = env_lines(capsys)
    assert lines["kernels"].startswith("reference (torch"), lines["kernels"]
    assert {"dcp-triton", "torch", "triton", "vllm", "sglang"} <= set(lines)


def test_env_names_the_interpreter_when_the_triton_kernels_are_asked_for(capsys, monkeypatch):
    monkeypatch.setenv("DCP_TRITON_KERNELS", "triton")
    assert env_lines(capsys)["kernels"] == "triton (interpreter, TRITON_INTERPRET=1)"


def test_env_refuses_a_kernel_path_that_does_not_exist_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("DCP_TRITON_KERNELS", "cuda")
    with pytest.raises(SystemExit) as exit_info:
        main(["env"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "DCP_TRITON_KERNELS='cuda'" in captured.err
    assert "['triton', 'reference']" in captured.err
