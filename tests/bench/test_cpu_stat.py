"""bench/cpu_stat.py reads cgroup v2 and v1 CPU statistics, and says None where there are none."""

from __future__ import annotations

from pathlib import Path

from k3verify.bench import cpu_stat


def test_cgroup_v2(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("usage_usec 10\nnr_throttled 3\nthrottled_usec 2500\n")
    (tmp_path / "cpu.max").write_text("800000 100000\n")
    assert cpu_stat.throttled_ms(tmp_path) == 2.5 and cpu_stat.quota_cpus(tmp_path) == 8.0
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_stat.quota_cpus(tmp_path) is None


def test_cgroup_v1(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.stat").write_text("nr_periods 5\nnr_throttled 1\nthrottled_time 7000000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_stat.throttled_ms(tmp_path) == 7.0 and cpu_stat.quota_cpus(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert cpu_stat.quota_cpus(tmp_path) == 4.0


def test_no_cgroup(tmp_path: Path) -> None:
    assert cpu_stat.throttled_ms(tmp_path) is None and cpu_stat.quota_cpus(tmp_path) is None
    assert cpu_stat.host_cpu(tmp_path)["cpus_usable"] >= 1
