"""The stage report: every rank's line, then each replica's pipeline step and bubble."""
from dualframe.pipeline.stage import timing_report


def test_timing_report_adds_one_pipeline_line_per_replica():
    gathered = [(0, "r0 s0", 3.0, 6.0), (0, "r0 s1", 3.0, 4.0), (1, "r1 s0", 1.0, 2.0), (1, "r1 s1", 1.5, 2.0)]
    assert timing_report(gathered) == [
        "r0 s0", "r0 s1", "r1 s0", "r1 s1",
        "replica 0 pipeline: step 6000.0 ms, bubble 50.0%",
        "replica 1 pipeline: step 2000.0 ms, bubble 37.5%",
    ]


def test_timing_report_before_any_step_has_no_pipeline_line():
    assert timing_report([(0, "s0", 0.0, 0.0), (0, "s1", 0.0, 0.0)]) == ["s0", "s1"]
