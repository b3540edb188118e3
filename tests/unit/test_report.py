"""trainlib.report on hand-written metrics: resumed runs, validation loss, the PNG and the page."""

import json
import math
import sys

import pytest

from trainlib.parity import LayoutRun, ParityReport
from trainlib.report import PARITY_FLOOR, figure, load_run, main, parity_panels, plot_parity, report, training_panels

NO_MPL = "the PNG needs matplotlib: pip install -e '.[dev]' (scripts/test.sh does)"


def write_run(folder, records, torn_tail=""):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)
    return folder


def record(step, loss, **extra):
    return {"step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3, "tokens_per_second": 1000.0 * step,
            "step_time_s": 0.1, "tflops": 0.01, "mfu": None, "peak_memory_gib": 0.5, **extra}


@pytest.fixture
def resumed(tmp_path):
    # Steps 1-6, val_loss on 3 and 6; resumed from a step-4 checkpoint: 5 and 6 logged again, then 7 and 8.
    # The crash left half a record at the end.
    first = [record(s, 10.0 - s, **({"val_loss": 10.5 - s} if s % 3 == 0 else {})) for s in range(1, 7)]
    again = [record(5, 4.75), record(6, 3.75, val_loss=3.14159), record(7, 2.75), record(8, 1.75)]
    return write_run(tmp_path / "resumed", first + again, torn_tail='{"step": 9, "lo')


def test_later_record_of_a_step_wins_and_a_torn_tail_is_dropped(resumed):
    run = load_run(resumed)
    assert [r["step"] for r in run.records] == list(range(1, 9))
    assert [r["loss"] for r in run.records] == [9.0, 8.0, 7.0, 6.0, 4.75, 3.75, 2.75, 1.75]
    assert [r.get("val_loss") for r in run.records if "val_loss" in r] == [7.5, 3.14159]


def test_figure_plots_every_field_and_validation_loss_as_its_own_line(resumed):
    pytest.importorskip("matplotlib", reason=NO_MPL)
    panels, legend = training_panels([load_run(resumed)])
    fig = figure(panels, legend, "t")
    loss_ax, lr_ax, gn_ax, tps_ax, mem_ax, key_ax = fig.axes
    train, val = loss_ax.lines
    assert list(train.get_ydata()) == [9.0, 8.0, 7.0, 6.0, 4.75, 3.75, 2.75, 1.75]
    assert (list(val.get_xdata()), list(val.get_ydata())) == ([3, 6], [7.5, 3.14159])
    assert val.get_linestyle() == "--" and train.get_linestyle() == "-"
    assert list(tps_ax.lines[0].get_ydata()) == [1000.0 * s for s in range(1, 9)]
    assert [ax.get_xlabel() for ax in fig.axes[:5]] == ["step"] * 5
    assert mem_ax.get_ylabel() == "peak memory (GiB)" and gn_ax.get_ylabel() == "grad_norm" and lr_ax.get_ylabel() == "lr"
    labels = [t.get_text() for t in key_ax.get_legend().get_texts()]
    assert labels[0] == "resumed: loss 9 -> 1.75 at step 8" and labels[1:] == ["training loss", "validation loss"]


def test_the_png_is_titled(resumed):
    pytest.importorskip("matplotlib", reason=NO_MPL)
    panels, legend = training_panels([load_run(resumed)])
    assert figure(panels, legend, "trainlib: resumed").get_suptitle() == "trainlib: resumed"


def test_the_legend_cell_and_the_spare_cells_draw_no_axes(resumed):
    pytest.importorskip("matplotlib", reason=NO_MPL)
    panels, legend = training_panels([load_run(resumed)])
    fig = figure(panels[:3], legend, "t")  # three panels and the legend: two rows, two cells spare
    assert [ax.axison for ax in fig.axes] == [True] * 3 + [False] * 3
    assert fig.axes[3].get_legend() is not None and all(ax.get_legend() is None for ax in fig.axes[4:])


def test_runs_are_told_apart_by_color_and_by_the_config_keys_that_differ(tmp_path):
    dirs = []
    for name, lr in (("a", 0.003), ("b", 0.001)):
        d = write_run(tmp_path / name, [record(1, 5.0), record(2, 4.0 if name == "a" else 4.5)])
        (d / "config.toml").write_text(f'[job]\ndump_folder = "{d}"\n\n[optimizer]\nlr = {lr}\nweight_decay = 0.1\n')
        dirs.append(d)
    panels, legend = training_panels([load_run(d) for d in dirs])
    assert [s.label for s in legend] == ["a (optimizer.lr=0.003): loss 5 -> 4 at step 2",
                                         "b (optimizer.lr=0.001): loss 5 -> 4.5 at step 2"]
    assert len({s.color for s in panels[0].series}) == 2


def test_report_writes_a_png_and_a_self_contained_page(resumed, tmp_path):
    matplotlib = pytest.importorskip("matplotlib.image", reason=NO_MPL)

    written = report([resumed], tmp_path / "out" / "r")
    assert written == [tmp_path / "out" / "r.html", tmp_path / "out" / "r.png"]
    page = written[0].read_text()
    assert "resumed" in page and "val_loss, step 6: 3.14159" in page and "<svg" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched
    png = matplotlib.imread(written[1])
    assert png.shape[:2] == (900, 1600)  # 16 x 9 inches at 100 dpi: two rows of three
    assert (png[..., :3] < 0.9).any(axis=-1).mean() > 0.01  # lines and text, not a blank canvas


def test_default_prefix_is_report_in_the_first_run(resumed, capsys):
    pytest.importorskip("matplotlib", reason=NO_MPL)
    assert main([str(resumed)]) == 0
    assert (resumed / "report.html").is_file() and (resumed / "report.png").is_file()
    assert capsys.readouterr().out.split() == ["wrote", str(resumed / "report.html"), "wrote",
                                               str(resumed / "report.png")]


def test_out_names_the_prefix_and_its_folder_is_made(resumed, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the page alone: the prefix, not the PNG, is tested here
    assert main([str(resumed), "--out", str(tmp_path / "new" / "cmp")]) == 0  # --out arrives as a str
    assert (tmp_path / "new" / "cmp.html").is_file() and not (resumed / "report.html").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'new' / 'cmp.html'}"


def test_without_matplotlib_the_page_is_still_written(resumed, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert report([resumed], tmp_path / "r") == [tmp_path / "r.html"]
    assert not (tmp_path / "r.png").exists()
    assert "skipped r.png: matplotlib is not installed (pip install 'trainlib[report]')" in capsys.readouterr().out


@pytest.mark.parametrize("content,expected", [
    (None, "no metrics.jsonl in"),
    ('{"step": 1, "loss": 2}\nnot json\n{"step": 3, "loss": 1}\n', "metrics.jsonl:2 is not a JSON record"),
    ("", "holds no records yet"),
])
def test_bad_run_folders_are_one_line_errors(tmp_path, capsys, content, expected):
    (tmp_path / "run").mkdir()
    if content is not None:
        (tmp_path / "run" / "metrics.jsonl").write_text(content)
    assert main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainlib.report: error: ") and expected in err and err.count("\n") == 1


def test_parity_plot_shows_each_layout_and_its_relative_deviation_on_a_log_axis(tmp_path):
    pytest.importorskip("matplotlib", reason=NO_MPL)
    base = [6.0, 5.0, 4.0]
    rep = ParityReport(LayoutRun("single", 1, base, [1.0] * 3))
    rep.runs = [LayoutRun("dp_shard=2", 2, [6.0, 5.0 * (1 + 1e-7), 4.0 * (1 - 3e-7)], [1.0] * 3, max_rel_loss=3e-7),
                LayoutRun("tp=2", 2, [6.0, 5.0, 4.0], [1.0] * 3)]
    panels, legend = parity_panels(rep, tol=1e-5)
    fig = figure(panels, legend, "t")
    curves, devs = fig.axes[:2]
    assert [line.get_label() for line in curves.lines] == ["single", "dp_shard=2", "tp=2"]
    assert devs.get_yscale() == "log"
    tol, dp, tp = devs.lines
    assert list(tol.get_ydata()) == [1e-5, 1e-5]
    assert [math.isclose(a, b, rel_tol=1e-6) for a, b in zip(dp.get_ydata(), [PARITY_FLOOR, 1e-7, 3e-7])] == [True] * 3
    assert list(tp.get_ydata()) == [PARITY_FLOOR] * 3  # bitwise equal: drawn at the floor, not dropped

    written = plot_parity(rep, tmp_path / "parity")
    assert [p.name for p in written] == ["parity.html", "parity.png"]
    page = written[0].read_text()
    assert "dp_shard=2" in page and "tp=2" in page and "3.00e-07" in page
    assert [s.label for s in legend] == ["single (baseline)", "dp_shard=2 (max 3.0e-07)", "tp=2 (max 0.0e+00)",
                                         "tolerance 1e-05"]


def test_runs_of_the_same_folder_name_are_named_by_their_paths(tmp_path):
    dirs = [write_run(tmp_path / where / "run", [record(1, 5.0), record(2, loss)])
            for where, loss in (("x", 4.0), ("y", 3.0))]
    page = report([str(d) for d in dirs], tmp_path / "r")[0].read_text()
    assert f"trainlib: {dirs[0]}, {dirs[1]}" in page  # the title; the table and legend name them the same way
    assert f"<td>{dirs[1]}</td>" in page


def test_blank_lines_in_metrics_are_skipped(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(json.dumps(record(1, 5.0)) + "\n\n" + json.dumps(record(2, 4.0)) + "\n")
    assert [r["loss"] for r in load_run(folder).records] == [5.0, 4.0]


@pytest.mark.parametrize("value,text", [(2_500_000, "2.5M"), (-12_345, "-12.3k"), (9_999, "9999"), (3.14159, "3.142"),
                                        (0.001234, "1.2e-03"), (0.0, "0")])
def test_numbers_on_the_page_are_short(value, text):
    from trainlib.report import _fmt

    assert _fmt(value) == text


def test_a_field_no_run_logged_is_drawn_as_no_data(tmp_path):
    from trainlib.report import html_page

    folder = write_run(tmp_path / "run", [{"step": s, "loss": 5.0 - s} for s in (1, 2)])  # no other field
    panels, legend = training_panels([load_run(folder)])
    page = html_page(panels, legend, "t", [["run"], ["run"]])
    assert page.count(">no data</text>") == len(panels) - 1  # all but the loss


def _svg(panel):
    import xml.etree.ElementTree as ET

    from trainlib.report import svg_panel

    root = ET.fromstring(svg_panel(panel))
    ns = "{http://www.w3.org/2000/svg}"
    lines = [[tuple(map(float, p.split(","))) for p in e.get("points").split()] for e in root.iter(ns + "polyline")]
    return root, ns, lines


def test_the_page_draws_each_series_where_its_values_are():
    from trainlib.report import Panel, Series

    train = Series("train", "#111111", [1, 2, 3, 4], [9.0, 8.0, 7.0, 6.0])
    val = Series("val", "#222222", [2, 4], [8.5, 6.5], dashed=True, markers=True)
    root, ns, (t, v) = _svg(Panel("loss", "loss", [train, val]))
    xs, ys = zip(*t)
    assert xs == tuple(sorted(xs)) and ys == tuple(sorted(ys))  # later steps right; lower loss lower (larger y)
    assert all(math.isclose(b - a, xs[1] - xs[0], abs_tol=0.2) for a, b in zip(xs, xs[1:]))  # linear in steps
    assert math.isclose(v[0][0], t[1][0], abs_tol=0.1) and t[0][1] < v[0][1] < t[1][1]  # 8.5: between 9 and 8
    polylines = list(root.iter(ns + "polyline"))
    assert polylines[0].get("stroke-dasharray") is None and polylines[1].get("stroke-dasharray") == "6,4"
    assert [c.find(ns + "title").text for c in root.iter(ns + "circle")] == ["val, step 2: 8.5", "val, step 4: 6.5"]
    labels = [e.text for e in root.iter(ns + "text")]
    assert "2" in labels and "3" in labels and "8" in labels  # step and loss ticks


def test_a_log_panel_spaces_decades_equally_and_labels_them():
    from trainlib.report import Panel, Series

    root, ns, (line,) = _svg(Panel("dev", "rel", [Series("d", "#111111", [1, 2, 3], [1e-7, 1e-6, 1e-5])], logy=True))
    (_, y1), (_, y2), (_, y3) = line
    assert y1 > y2 > y3 and math.isclose(y1 - y2, y2 - y3, abs_tol=0.2)
    assert {"1e-7", "1e-6", "1e-5"} <= {e.text for e in root.iter(ns + "text")}


# ------------------------------------------------------------------ MoE runs
MOE_TITLE = "MoE load imbalance (max/mean tokens per expert)"
IMBALANCE = {10: {"1": 1.2, "2": 1.5, "3": 2.5}, 20: {"1": 1.1, "2": 1.4, "3": 2.0},
             30: {"1": 1.0, "2": 1.3, "3": 1.8}, 40: {"1": 1.05, "2": 1.25, "3": 1.6}}  # layer 0 is dense


def moe_record(step, loss, dropped=(0, 0, 0)):
    return record(step, loss, moe_aux_loss=0.01 * step, moe_z_loss=0.0, moe_load_imbalance=IMBALANCE[step],
                  moe_dropped_tokens=dict(zip(("1", "2", "3"), dropped)))


@pytest.fixture
def moe_run(tmp_path):
    # steps 10-40 log the MoE fields; the z-loss is off (all zero); tokens are dropped at step 20 only
    return write_run(tmp_path / "moe", [moe_record(10, 5.0), moe_record(20, 4.0, dropped=(3, 0, 4)),
                                        moe_record(30, 3.5), moe_record(40, 3.0)])


def _svgs(page):
    """Each <svg> of the page as an ElementTree, by its first <text> (the title)."""
    import re
    import xml.etree.ElementTree as ET

    roots = [ET.fromstring(m) for m in re.findall(r"<svg .*?</svg>", page, flags=re.S)]
    return {next(r.iter("{http://www.w3.org/2000/svg}text")).text: r for r in roots} if roots else {}, roots


def _cells(root):
    ns = "{http://www.w3.org/2000/svg}"
    return [(e.find(ns + "title").text, e.get("fill")) for e in root.iter(ns + "rect")
            if e.find(ns + "title") is not None]  # the key's swatches have no title


def test_a_moe_run_gets_a_heat_map_of_each_layer_over_the_steps(moe_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the page alone
    page = report([moe_run], tmp_path / "r")[0].read_text()
    roots = [r for r in _svgs(page)[1] if MOE_TITLE in "".join(r.itertext())]
    assert len(roots) == 1
    cells = dict(_cells(roots[0]))
    assert len(cells) == 4 * 3  # one rect per (logged step, MoE layer)
    assert cells["layer 2, step 20: 1.4"] and cells["layer 3, step 10: 2.5"] and cells["layer 1, step 30: 1"]
    assert cells["layer 3, step 10: 2.5"] == "#800026" and cells["layer 1, step 30: 1"] == "#ffffcc"  # max, min
    texts = [t for t in roots[0].itertext() if t.strip()]
    assert {"1", "2", "3", "MoE layer", "step", "moe", "2.5"} <= set(texts)  # layer labels, axes, run, key's max
    assert texts[-4:] == ["2.5", "1", "max", "min"]  # the key: the highest and lowest value
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_rows_are_layers_bottom_up_and_columns_sit_at_their_steps(moe_run):
    ns = "{http://www.w3.org/2000/svg}"
    from trainlib.report import HeatMap, svg_heat_map

    (hm,) = [p for p in training_panels([load_run(moe_run)])[0] if isinstance(p, HeatMap)]
    assert hm.rows == ["1", "2", "3"] and hm.edges == [5.0, 15.0, 25.0, 35.0, 45.0]
    import xml.etree.ElementTree as ET

    rects = {e.find(ns + "title").text.split(":")[0]: e for e in ET.fromstring(svg_heat_map(hm)).iter(ns + "rect")
             if e.find(ns + "title") is not None}
    y = lambda k: float(rects[k].get("y"))  # noqa: E731
    x = lambda k: float(rects[k].get("x"))  # noqa: E731
    assert y("layer 1, step 10") > y("layer 2, step 10") > y("layer 3, step 10")  # layer 1 at the bottom
    assert x("layer 1, step 10") < x("layer 1, step 20") < x("layer 1, step 40")


def test_moe_losses_and_dropped_tokens_are_drawn_where_not_all_zero(moe_run):
    panels = training_panels([load_run(moe_run)])[0]
    by_title = {p.title: p for p in panels}
    assert "MoE router z-loss" not in by_title  # all zero: nothing to see
    (aux,) = by_title["MoE load-balancing loss"].series
    assert (aux.steps, aux.values) == ([10, 20, 30, 40], [0.1, 0.2, 0.3, 0.4])
    (dropped,) = by_title["MoE dropped tokens (sum over layers)"].series
    assert (dropped.steps, dropped.values) == ([10, 20, 30, 40], [0, 7, 0, 0])


def test_the_summary_has_the_last_steps_mean_and_max_imbalance(moe_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = report([moe_run], tmp_path / "r")[0].read_text()
    assert "<th>last MoE imbalance mean</th><th>last MoE imbalance max</th>" in page
    assert "<td>0.5</td><td>1.3</td><td>1.6</td></tr>" in page  # peak memory, then step 40's mean and max


def test_several_runs_get_a_heat_map_each_and_a_dense_one_none(moe_run, resumed, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    other = write_run(tmp_path / "moe2", [moe_record(10, 5.0), moe_record(20, 4.5)])
    page = report([moe_run, resumed, other], tmp_path / "r")[0].read_text()
    maps = [r for r in _svgs(page)[1] if MOE_TITLE in "".join(r.itertext())]
    assert [[t for t in r.itertext()][1] for r in maps] == ["moe", "moe2"]  # labelled by their runs
    assert [len(_cells(r)) for r in maps] == [12, 6]
    assert "<td>resumed</td>" in page and "<td>-</td><td>-</td></tr>" in page  # no imbalance for the dense run


def test_a_dense_run_has_no_moe_panels_or_columns(resumed, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = report([resumed], tmp_path / "r")[0].read_text()
    assert "MoE" not in page and not any(_cells(r) for r in _svgs(page)[1])
    assert len(training_panels([load_run(resumed)])[0]) == 5


def test_the_png_draws_the_heat_map_with_a_colour_bar(moe_run, tmp_path):
    image = pytest.importorskip("matplotlib.image", reason=NO_MPL)
    panels, legend = training_panels([load_run(moe_run)])
    fig = figure(panels, legend, "t")
    (ax,) = [a for a in fig.axes if a.get_title().startswith(MOE_TITLE)]
    assert ax.get_title() == MOE_TITLE + "\nmoe"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "MoE layer")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2", "3"]
    (mesh,) = ax.collections
    assert mesh.get_array().reshape(3, 4).tolist() == [[IMBALANCE[s][k] for s in (10, 20, 30, 40)] for k in "123"]
    assert mesh.colorbar is not None and mesh.colorbar.ax.get_ylabel() == "max / mean (1 = balanced)"

    written = report([moe_run], tmp_path / "r")
    assert [p.name for p in written] == ["r.html", "r.png"]
    assert image.imread(written[1]).shape[:2] == (1350, 1600)  # 8 panels and the legend: three rows


def test_long_runs_average_neighbouring_steps_into_at_most_max_columns():
    from trainlib.report import heat_map

    steps = list(range(1, 1001))
    hm = heat_map("t", "run", steps, [{"0": float(s), "7": 1.0} for s in steps], max_columns=240)
    assert len(hm.edges) - 1 == len(hm.spans) == len(hm.values[0]) == 200  # 5 steps a column
    assert hm.spans[0] == (1, 5) and hm.values[0][0] == 3.0 and hm.values[1] == [1.0] * 200
    assert hm.edges[0] == 0.5 and hm.edges[1] == 5.5 and hm.edges[-1] == 1000.5


def test_a_layer_missing_at_a_step_is_left_blank_and_layers_sort_as_numbers():
    from trainlib.report import heat_map

    hm = heat_map("t", "run", [1, 3], [{"10": 1.0, "9": 2.0}, {"9": float("nan"), "2": 1.5}])
    assert hm.rows == ["2", "9", "10"]
    assert hm.values == [[None, 1.5], [2.0, None], [1.0, None]] and hm.edges == [0.0, 2.0, 4.0]


def test_a_torn_record_is_skipped_with_a_note_where_a_relaunch_appended_after_it(tmp_path, capsys):
    # issue 54 item 6: a kill tore the last line and the relaunched run (before it dropped such a tail)
    # appended its first record to it; the report refused the whole run. A torn last line is noted too.
    first = [record(s, 10.0 - s) for s in (1, 2)]
    folder = write_run(tmp_path / "run", first, torn_tail='{"step": 3, "lo' + json.dumps(record(3, 6.5)) + "\n"
                       + json.dumps(record(4, 5.5)) + "\n" + '{"step": 5')
    assert [r["loss"] for r in load_run(folder).records] == [9.0, 8.0, 6.5, 5.5]
    err = capsys.readouterr().err
    assert f"{folder / 'metrics.jsonl'}:3: skipped a torn record (15 bytes cut mid-write) before step 3's" in err
    assert f"{folder / 'metrics.jsonl'}:5: skipped a torn last record (10 bytes cut mid-write)" in err
