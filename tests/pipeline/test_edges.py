"""What a new user hits at the edges (issue 22), through the installed console script: every one of these must
end in the first second with exit 2 (or 1 where rerunning later helps) and a message naming the thing and the
fix, before any work and without a traceback. None of them starts Ray."""
from __future__ import annotations

import json
import os
import random
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml


def assert_refused(res, code: int, *needles: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


def nothing_written(out: Path) -> bool:
    return not out.exists() or not list(out.glob("part-*"))


# -- 1: every output path is checked before any work ---------------------------------------------------------
def test_output_paths_are_checked_before_any_work(tmp_path, h, synthetic):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    res = h.run_console("run", str(cfg), "--stats-json", str(tmp_path / "no" / "such" / "dir" / "s.json"))
    assert_refused(res, 2, "--stats-json", str(tmp_path / "no" / "such" / "dir"))
    assert not (tmp_path / "out").exists(), "the job ran although its statistics could not be written"
    res = h.run_console("run", str(cfg), "--stats-json", str(tmp_path))             # a directory, not a file
    assert_refused(res, 2, "--stats-json", "is a directory")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = h.run_console("run", str(cfg), "--output", str(blocker / "out"))          # cannot be created
    assert_refused(res, 2, "--output", "is a file")
    res = h.run_console("run", str(cfg), "--output", str(blocker))                 # item 13: --output is named
    assert_refused(res, 2, "--output: exists and is not a directory")
    assert "output.directory" not in res.stderr
    inside = h.write_config(tmp_path / "job2.yaml", manifest, output={"directory": str(blocker / "out")})
    assert_refused(h.run_console("validate", str(inside)), 2, "output.directory", "is a file")
    definition = tmp_path / "nightly.yaml"
    definition.write_text(yaml.safe_dump({"name": "n", "schedule": "0 2 * * *", "history": "hist", "jobs": [str(cfg)]}))
    for flags in (["--write-dir", str(blocker / "units")], ["--html", str(tmp_path)]):
        command = ["schedule", str(definition)] if flags[0] == "--write-dir" else ["report", str(definition)]
        assert_refused(h.run_console(*command, *flags), 2, flags[0])


# -- 4: an unknown prompt placeholder ----------------------------------------------------------------------------
@pytest.mark.parametrize("template, named", [
    ("Q: {question}\n{options}\nHint: {foo}", "{foo}"),
    ("{question} {options} {0}", "{0}"),
    ("{question} {options} {}", "{}"),
    ("{question} {options} {", "valid format string"),
    ("{question} {options} {question.nope}", "cannot be filled in"),
])
def test_unknown_template_placeholder_is_refused_before_any_work(tmp_path, h, synthetic, template, named):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, prompt={"template": template})
    for command in ("validate", "run"):
        assert_refused(h.run_console(command, str(cfg)), 2, "prompt.template", named)
    assert not (tmp_path / "out").exists()


def test_template_rule_matches_what_the_engine_formats(rng):
    """On random templates: the config accepts a template iff the engines' `format(question=..., options=...)`
    fills it in and the result holds both the question and the options. The markers have distinct characters, so
    no piece (`{question[0]}` repeated, say) can spell a whole marker without naming the whole field."""
    from pydantic import ValidationError

    from batchjob.config import PromptConfig

    pieces = ["{question}", "{options}", "{foo}", "{}", "{{", "}}", "{0}", "{question!r}", "{options:>3}", "text ",
              "{question[0]}", "{options.nope}", "\n", "{", "}"]
    for _ in range(500):
        template = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        try:
            filled = template.format(question="Qx7", options="Oy8")
            works = "Qx7" in filled and "Oy8" in filled
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            works = False
        try:
            PromptConfig(template=template)
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted == works, template


# -- 5: a binary file where a YAML file belongs ---------------------------------------------------------------------
BINARY_COMMANDS = ["validate {bin}.yaml", "run {bin}.yaml", "nightly {bin}.yaml", "history {bin}.yaml",
                   "schedule {bin}.yaml", "diff --last {bin}.yaml", "report {bin}.yaml", "report {bin}",
                   "report {bin}.yaml --html {tmp}/r.html"]


@pytest.mark.parametrize("command", BINARY_COMMANDS, ids=lambda c: c.replace("{bin}", "BIN").replace("{tmp}/", ""))
def test_a_binary_file_given_as_config_exits_2_naming_it(tmp_path, h, command, rng):
    args = command.format(bin=tmp_path / "config", tmp=tmp_path).split()
    binary = Path(next(a for a in args if a.startswith(str(tmp_path / "config"))))
    binary.write_bytes(rng.randbytes(2000) + b"\xff\xfe\x00")
    res = h.run_console(*args)
    assert_refused(res, 2, str(binary))
    assert "not a text file" in res.stderr or "needs a nightly definition" in res.stderr, res.stderr


def test_a_binary_manifest_exits_2_naming_it(tmp_path, h, synthetic, rng):
    manifest, _ = synthetic
    data = tmp_path / "data"
    shutil.copytree(manifest.parent / "clips", data / "clips")
    (data / "manifest.jsonl").write_bytes(rng.randbytes(3000) + b"\xff")
    cfg = h.write_config(tmp_path / "job.yaml", data / "manifest.jsonl")
    assert_refused(h.run_console("validate", str(cfg)), 2, "manifest.jsonl", "cannot read manifest")


# -- 7: duplicate keys -------------------------------------------------------------------------------------------
def test_duplicate_yaml_keys_are_refused(tmp_path, h, synthetic):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    text = cfg.read_text()
    cfg.write_text(text + "loader:\n  name: pyav_keyframes\n")     # a second `loader:` resets num_frames
    for command in ("validate", "run"):
        assert_refused(h.run_console(command, str(cfg)), 2, "key 'loader' appears twice", str(cfg))
    nested = tmp_path / "nested.yaml"
    nested.write_text(text.replace("  num_frames: 4\n", "  num_frames: 4\n  num_frames: 8\n"))
    assert_refused(h.run_console("validate", str(nested)), 2, "key 'num_frames' appears twice")
    definition = tmp_path / "nightly.yaml"
    definition.write_text(f"name: n\nschedule: '0 2 * * *'\nhistory: hist\njobs: [{cfg}]\nhistory: other\n")
    for command in ("nightly", "schedule", "history"):
        assert_refused(h.run_console(command, str(definition)), 2, "key 'history' appears twice")
    assert not (tmp_path / "out").exists() and not (tmp_path / "hist").exists()


def test_duplicate_keys_at_any_depth_are_found(rng):
    from batchjob.yamlfile import YamlFileError, parse_yaml

    for _ in range(50):
        doc: dict = {}
        node, path = doc, []
        for depth in range(rng.randint(1, 4)):
            key = f"k{depth}"
            node[key] = {f"x{i}": i for i in range(rng.randint(1, 4))}
            path.append(key)
            node = node[key]
        text = yaml.safe_dump(doc, default_flow_style=rng.random() < 0.3)
        assert parse_yaml(text) == doc                      # no false alarm
        lines = text.splitlines()
        if text.lstrip().startswith("{"):
            dup = text.replace("x0: 0", "x0: 0, x0: 1", 1)
        else:
            i = next(j for j, ln in enumerate(lines) if ln.strip().startswith("x0:"))
            lines.insert(i + 1, lines[i].replace(": 0", ": 7"))
            dup = "\n".join(lines)
        with pytest.raises(YamlFileError, match="'x0' appears twice"):
            parse_yaml(dup)
    merged = "base: &b {a: 1, b: 2}\nuse:\n  <<: *b\n  b: 3\n"      # a merge key may be overridden
    assert parse_yaml(merged)["use"] == {"a": 1, "b": 3}


# -- 8: validate reports missing clips and the existing output ------------------------------------------------------
def copy_dataset(tmp_path: Path, manifest: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(manifest.parent / "clips", data / "clips")
    shutil.copy(manifest, data / "manifest.jsonl")
    return data / "manifest.jsonl"


def test_validate_reports_missing_clips(tmp_path, h, synthetic, rng):
    manifest, clips = synthetic
    data = copy_dataset(tmp_path, manifest)
    gone = rng.sample([c["video"] for c in clips], 2)
    for name in gone:
        (data.parent / "clips" / name).unlink()
    relaxed = h.write_config(tmp_path / "job.yaml", data, runtime={"max_error_fraction": 0.5})
    res = h.run_console("validate", str(relaxed))
    assert res.returncode == 0, res.stderr
    assert f"2 of {len(clips)} clips not found (6 of {3 * len(clips)} rows)" in res.stderr, res.stderr
    first = [c["video"] for c in clips if c["video"] in gone][0]
    assert first in res.stderr
    strict = h.write_config(tmp_path / "job.yaml", data)                # 6 of 24 rows > 5 %: run would exit 1
    assert_refused(h.run_console("validate", str(strict)), 2, "runtime.max_error_fraction", "2 of")
    empty = tmp_path / "empty"
    empty.mkdir()
    nowhere = h.write_config(tmp_path / "job.yaml", data, dataset={"video_root": str(empty)})
    assert_refused(h.run_console("validate", str(nowhere)), 2, f"{len(clips)} of {len(clips)} clips not found")
    res = h.run_console("run", str(nowhere))                             # would only write error rows
    assert_refused(res, 2, "none of the", "dataset.video_root", "mounted")
    assert nothing_written(tmp_path / "out")


def test_a_few_missing_clips_never_stop_a_run(tmp_path, synthetic, rng):
    """Only a dataset none of whose clips exists stops a run: clips that are really gone keep becoming error rows
    (so a nightly retry of them does not fail every night)."""
    from batchjob.config import ConfigError, load_config
    from batchjob.datasets import load_rows
    from batchjob.preflight import refuse_if_no_clip_exists

    manifest, clips = synthetic
    data = copy_dataset(tmp_path, manifest)
    gone = rng.sample([c["video"] for c in clips], 3)
    for name in gone:
        (data.parent / "clips" / name).unlink()
    cfg_path = tmp_path / "job.yaml"
    cfg_path.write_text(yaml.safe_dump({"job": "t", "dataset": {"adapter": "manifest", "annotation": str(data),
                                                                "video_root": str(data.parent / "clips")},
                                        "model": {"checkpoint": "Org/model", "engine": "vllm"},
                                        "output": {"directory": str(tmp_path / "out")}}))
    cfg = load_config(cfg_path)
    rows = load_rows(cfg.dataset)
    pending = [r for r in rows if Path(r.video).name in gone]
    refuse_if_no_clip_exists(cfg, pending, rows)                 # the others exist: error rows, no refusal
    refuse_if_no_clip_exists(cfg, [], rows)
    for c in clips:
        (data.parent / "clips" / c["video"]).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="none of the dataset's clips exists"):
        refuse_if_no_clip_exists(cfg, pending, rows)


def write_output(directory: Path, rows: int, fingerprint: str, rng: random.Random, per_part: int = 4) -> None:
    from batchjob.pipeline.output import MANIFEST, PartWriter

    now = datetime(2026, 1, 31, tzinfo=timezone.utc)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps({"fingerprint": fingerprint}))
    w = PartWriter(directory, {"fingerprint": fingerprint, "job": "test"}, per_part, 1e9)
    for i in range(rows):
        n = rng.randint(2, 5)
        pred = rng.randrange(n)
        w.add([{"row_id": f"r{i}", "video": "v.mp4", "question": "q?", "options": [str(k) for k in range(n)],
                "answer": rng.randrange(n), "category": "c", "pred_index": pred, "pred_letter": "ABCDE"[pred],
                "probs": [1 / n] * n, "correct": None, "error": None, "model": "m", "run_id": "r",
                "run_started_at": now, "finished_at": now}])
    w.flush()


def test_a_refused_run_does_not_block_the_corrected_config(tmp_path, h, synthetic):
    """A run refused before any row (here: no clip at the video_root) leaves the output's manifest behind; the
    corrected config (another fingerprint: more frames) validates and would run, not "use --restart"."""
    manifest, _ = synthetic
    unmounted = tmp_path / "unmounted"
    cfg = h.write_config(tmp_path / "job.yaml", manifest, dataset={"video_root": str(unmounted)})
    assert_refused(h.run_console("validate", str(cfg)), 2, f"directory not found: {unmounted}", "mounted")
    unmounted.mkdir()                 # a mount point with nothing mounted on it: the run itself refuses
    res = h.run_console("run", str(cfg))
    assert_refused(res, 2, "none of the dataset's clips exists")
    assert "0/?" not in res.stderr, res.stderr       # no progress bar for a run that never started
    assert (tmp_path / "out" / "_job.json").exists() and nothing_written(tmp_path / "out")
    cfg = h.write_config(tmp_path / "job.yaml", manifest, loader={"num_frames": 6})
    res = h.run_console("validate", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]


def test_validate_reports_the_existing_outputs_fingerprint_and_damage(tmp_path, h, synthetic, rng):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    write_output(tmp_path / "out", 9, "0123456789abcdef", rng)
    assert_refused(h.run_console("validate", str(cfg)), 2, "another config", "--restart")
    from batchjob.config import load_config

    shutil.rmtree(tmp_path / "out")
    write_output(tmp_path / "out", 9, load_config(cfg).fingerprint(), rng)
    assert h.run_console("validate", str(cfg)).returncode == 0
    part = sorted((tmp_path / "out").glob("part-*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:100])
    assert_refused(h.run_console("validate", str(cfg)), 2, "damaged part", part.name, "--repair")


# -- 9: schedule validates the jobs; an exit-2 night alerts ----------------------------------------------------------
def definition_for(tmp_path: Path, jobs: list[str], **extra) -> Path:
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump({"name": "n", "schedule": "30 1 * * *", "history": "hist", "jobs": jobs,
                                    "alert": {"on_failure": f"cat > {tmp_path}/alert.txt"}, **extra}))
    return path


def test_schedule_refuses_a_definition_whose_jobs_would_fail(tmp_path, h, synthetic):
    manifest, _ = synthetic
    good = h.write_config(tmp_path / "good.yaml", manifest)
    assert h.run_console("schedule", str(definition_for(tmp_path, [str(good)]))).returncode == 0
    missing = definition_for(tmp_path, [str(good), "gone.yaml"])
    assert_refused(h.run_console("schedule", str(missing)), 2, "jobs.1", "gone.yaml")
    bad = h.write_config(tmp_path / "bad.yaml", manifest, loader={"name": "decord"})
    assert_refused(h.run_console("schedule", str(definition_for(tmp_path, [str(bad)]))), 2, "jobs.0",
                   "loader.name")
    unreadable = h.write_config(tmp_path / "bad.yaml", manifest, dataset={"annotation": str(tmp_path / "no.jsonl")})
    assert_refused(h.run_console("schedule", str(definition_for(tmp_path, [str(unreadable)]))), 2, "no.jsonl")
    assert not (tmp_path / "alert.txt").exists(), "schedule is interactive: it does not alert"


def test_a_night_that_cannot_start_still_alerts(tmp_path, h):
    path = definition_for(tmp_path, ["gone.yaml"])
    res = h.run_console("nightly", str(path), "--date", "2026-02-03")
    assert_refused(res, 2, "gone.yaml")
    alert = (tmp_path / "alert.txt").read_text()
    assert "FAILED" in alert and "did not start" in alert and "gone.yaml" in alert
    (tmp_path / "alert.txt").unlink()
    broken = definition_for(tmp_path, ["gone.yaml"], retry_errors="yes")     # the definition itself is invalid
    res = h.run_console("nightly", str(broken), "--date", "2026-02-03")
    assert_refused(res, 2, "retry_errors")
    assert "retry_errors" in (tmp_path / "alert.txt").read_text()
    assert (tmp_path / "hist" / "logs" / "2026-02-03" / "on_failure.log").is_file()


# -- 11: loader.kwargs are checked against what the loader reads -----------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    ({"fsp": 2}, ["loader.kwargs.fsp: unknown keyword", "fps, use_index"]),
    ({"use_index": "no"}, ["loader.kwargs.use_index: expected bool"]),
    ({"num_frames": 8}, ["loader.kwargs.num_frames: set loader.num_frames instead"]),
    ({"max_decoded_frames": 64}, ["loader.kwargs.max_decoded_frames: unknown keyword"]),   # pyav_adaptive's
])
def test_unknown_loader_kwargs_are_refused(tmp_path, h, synthetic, kwargs, named):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, loader={"kwargs": kwargs})
    for command in ("validate", "run"):
        assert_refused(h.run_console(command, str(cfg)), 2, *named)
    assert not (tmp_path / "out").exists()


def test_declared_loader_kwargs_validate(tmp_path, h, synthetic):
    manifest, _ = synthetic
    for loader, kwargs in (("pyav_keyframes", {"fps": 2, "use_index": False}),
                           ("pyav_adaptive", {"max_decoded_frames": 64, "fps": 1.5})):
        cfg = h.write_config(tmp_path / "job.yaml", manifest, loader={"name": loader, "kwargs": kwargs})
        res = h.run_console("validate", str(cfg))
        assert res.returncode == 0, res.stderr


def test_loaders_still_ignore_unknown_kwargs_from_vllm(synthetic):
    """vLLM hands every media kwarg to every loader: only job configs are held to the declaration."""
    from batchjob.loaders import get_loader, list_loaders, load_video
    from batchjob.loaders.registry import option_problems

    manifest, clips = synthetic
    path = str(manifest.parent / "clips" / clips[0]["video"])
    frames, meta = load_video(path, num_frames=3, max_duration=300, video_backend="x", some_future_kwarg=1)
    assert frames.shape[0] == 3
    for name in list_loaders():
        assert option_problems(get_loader(name), {"fps": 1}) == []

    class ThirdParty:     # declares nothing: its keywords cannot be checked, so none is refused
        pass

    assert option_problems(ThirdParty, {"anything": 1}) == []


# -- 13: the smaller ones ------------------------------------------------------------------------------------------
def test_loaders_lists_descriptions_and_keywords(h):
    res = h.run_console("loaders")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for name in ("pyav_keyframes", "pyav_adaptive", "opencv"):
        line = next(ln for ln in lines if ln.startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line          # a description, not the name alone
    assert "loader.kwargs.fps" in res.stdout and "loader.kwargs.max_decoded_frames" in res.stdout


def test_video_not_found_hint_fits_the_path(tmp_path, monkeypatch):
    from batchjob.loaders import VideoNotFound, load_video

    with pytest.raises(VideoNotFound) as absolute:
        load_video(str(tmp_path / "nope.mp4"))
    assert "relative" not in str(absolute.value) and "mounted" in str(absolute.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VideoNotFound) as relative:
        load_video("nope.mp4")
    assert "relative paths resolve against the working directory" in str(relative.value)


def test_a_locked_output_exits_1_like_nightly(tmp_path, h, synthetic):
    from batchjob.pipeline.output import lock_output

    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    fd = lock_output(tmp_path / "out")
    try:
        res = h.run_console("run", str(cfg))
    finally:
        os.close(fd)
    assert_refused(res, 1, "another batchjob run is writing here")
    assert "config error" not in res.stderr


def test_history_job_must_exist(tmp_path, h, synthetic):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    path = definition_for(tmp_path, [str(cfg)])
    assert_refused(h.run_console("history", str(path), "--job", "nope"), 2, "'nope'", "jobs: test")
    ok = h.run_console("history", str(path), "--job", "test")        # a job of the definition, no runs yet
    assert ok.returncode == 0 and "no runs" in ok.stderr, ok.stderr
    assert_refused(h.run_console("diff", "--last", str(path), "--job", "nope"), 2, "'nope'")


def test_report_takes_date_for_dated_outputs(tmp_path, h, synthetic, rng):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, output={"directory": str(tmp_path / "out" / "{date}")})
    n = rng.randint(3, 12)
    write_output(tmp_path / "out" / "2026-01-31", n, "f", rng)
    res = h.run_console("report", str(cfg), "--date", "2026-01-31", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["rows"] == n
    assert_refused(h.run_console("report", str(tmp_path / "out" / "2026-01-31"), "--date", "2026-01-31"), 2,
                   "--date")
    assert_refused(h.run_console("report", str(cfg), "--date", "2026-02-30"), 2, "YYYY-MM-DD")


def test_retry_errors_has_a_no_form(tmp_path, h, synthetic):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, loader={"num_frame": 4})
    conflict = h.run_console("run", str(cfg), "--retry-errors", "--restart")
    assert_refused(conflict, 2, "--restart discards")
    res = h.run_console("run", str(cfg), "--retry-errors", "--restart", "--no-retry-errors")
    assert_refused(res, 2, "loader.num_frame")        # the flag was turned off: the config's own error shows
