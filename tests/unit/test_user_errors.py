"""A user's mistake ends in one line naming what was wrong and a non-zero exit, never a traceback."""

from backends.deploy import launcher
from backends.deploy.ports import free_ports
from clients import demo, infer


def test_a_missing_image_file_is_one_line(capsys):
    assert infer.main(["--image", "/nonexistent/a.jpg"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: cannot read --image /nonexistent/a.jpg: No such file or directory"


def test_a_checkpoint_that_is_not_one_is_one_line_for_make_run_and_the_launcher(capsys):
    assert demo.main(["--device", "cpu", "--checkpoint", "/nonexistent"]) == 2
    assert capsys.readouterr().err.strip() == "error: CHECKPOINT=/nonexistent: checkpoint /nonexistent has no config.json"
    http, grpc, metrics = free_ports(3)
    code = launcher.main(["--device", "cpu", "--checkpoint", "/nonexistent", "--address", "127.0.0.1",
                          "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)])
    out = capsys.readouterr().err
    assert code == 2 and out.strip() == "error: checkpoint /nonexistent has no config.json"


def test_a_bad_instance_count_is_one_line(capsys):
    http, grpc, metrics = free_ports(3)
    code = launcher.main(["--device", "cpu", "--encoder-instances", "0", "--address", "127.0.0.1",
                          "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)])
    out = capsys.readouterr().err
    assert code == 2 and out.startswith("error: gpus and instance counts must be at least 1") and "Traceback" not in out


def test_a_tritonserver_that_is_not_one_is_one_line(capsys, tmp_path):
    http, grpc, metrics = free_ports(3)
    code = launcher.main(["--device", "cpu", "--tritonserver", str(tmp_path / "tritonserver"), "--address", "127.0.0.1",
                          "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: {tmp_path / 'tritonserver'} is not an executable tritonserver " \
                                         "(--tritonserver, KIMI_TRITONSERVER)"


def test_an_address_of_no_interface_here_is_named_as_such(capsys):
    code = launcher.main(["--device", "cpu", "--address", "10.250.250.250"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot listen on 10.250.250.250:8000 for HTTP" in err and "--address" in err
