"""tools/slurm_cluster.py's refusals, which need no SLURM: what is missing, and where.
(Starting and stopping a real cluster is what .ci/run and `make slurm-test` do.)"""

import socket

import pytest
import slurm_cluster  # tools/slurm_cluster.py (pytest's pythonpath)


def test_missing_programs_are_named_with_the_packages_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(slurm_cluster.shutil, "which",
                        lambda name: None if name in ("slurmd", "munged") else f"/usr/bin/{name}")
    assert slurm_cluster.main(["start", str(tmp_path / "cluster")]) == 1
    said = capsys.readouterr().err
    assert "slurmd, munged not found" in said
    assert "apt-get install slurmctld slurmd slurm-client munge" in said
    assert not (tmp_path / "cluster").exists()  # nothing written, nothing started


def test_a_folder_below_one_others_cannot_enter_is_refused(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(slurm_cluster.ClusterError, match=r"private is not enterable .*"
                                                         r"drwx------.*munged refuses"):
        slurm_cluster.check_traversable(private / "cluster")


def test_stopping_where_no_cluster_is_says_so(tmp_path, capsys):
    assert slurm_cluster.main(["stop", str(tmp_path)]) == 1
    assert f"no cluster in {tmp_path} (no slurm.conf)" in capsys.readouterr().err


def test_a_folder_holding_a_cluster_is_not_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_cluster, "missing_programs", lambda: [])
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    (tmp_path / "slurm.conf").write_text("ClusterName=other\n")
    with pytest.raises(slurm_cluster.ClusterError, match="already holds a cluster: stop it"):
        slurm_cluster.start(tmp_path)
    assert (tmp_path / "slurm.conf").read_text() == "ClusterName=other\n"


def test_the_ports_are_distinct_and_free():
    ports = slurm_cluster.free_ports(2)
    assert len(set(ports)) == 2
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: binding succeeds


def test_the_configuration_keeps_the_cluster_on_loopback_in_its_folder(tmp_path):
    text = slurm_cluster.configuration(tmp_path, "root", 7001, 7002)
    settings = dict(line.split("=", 1) for line in text.splitlines()
                    if "=" in line and not line.startswith(("#", "NodeName", "Partition")))
    assert settings["CommunicationParameters"] == "NoCtldInAddrAny,NoInAddrAny"
    assert (settings["SlurmctldPort"], settings["SlurmdPort"]) == ("7001", "7002")
    for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile",
                "SlurmctldLogFile", "SlurmdLogFile"):
        assert settings[key].startswith(str(tmp_path)), key
    assert "NodeAddr=127.0.0.1 CPUs=8" in text
