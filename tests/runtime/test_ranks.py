"""Outside any launch, the dist helpers describe a single process: rank 0 of 1, on the CPU."""

import mgpu_helpers as mh


def test_single_process_answers(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (mh.rank(), mh.world_size(), mh.local_rank()) == (0, 1, 0)
    assert mh.is_main()
    assert str(mh.device()) == "cpu"


def test_local_rank_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert mh.local_rank() == 3


def test_print0_prints_on_rank_0(capsys):
    mh.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
