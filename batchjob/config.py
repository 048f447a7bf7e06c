"""Job configuration: the YAML a nightly cron line points at, validated before any work starts.

A bad config must fail in the first second with a message that names the file and the key, never
after an hour of decoding. So the schema forbids unknown keys and type coercion, relative paths are
resolved against the config file (cron runs from an arbitrary working directory), and every path the
job will read is checked up front.
"""
from __future__ import annotations

import hashlib
import json
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchjob.location import LocationError, check_supported, is_url, local_path, redact, scheme
from batchjob.yamlfile import YamlFileError, read_yaml

# The most options a question may have: five single-token labels (A-E) is what the engines' prompts and
# option-token readout are built and tested for.
MAX_OPTIONS = 5
# What a prompt template may name: the engines format it with exactly these.
TEMPLATE_FIELDS = ("question", "options")


class ConfigError(Exception):
    """A config problem the user fixes by editing the YAML (the CLI exits with code 2)."""


def _int_to_float(v: Any) -> Any:
    # YAML writes `8` for 8.0; strict mode would reject it, which helps nobody.
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


Float = Annotated[float, BeforeValidator(_int_to_float)]


class _Section(BaseModel):
    # strict: "16" is not silently 16; extra=forbid: a typo such as `num_frame` is an error, not a default.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class DatasetConfig(_Section):
    adapter: Literal["nextqa", "mvbench", "manifest"]
    annotation: str = Field(description="NExTQA MC csv/parquet, MVBench json file or directory, manifest jsonl/csv")
    video_root: str | None = Field(None, description="directory or URL prefix (s3://, gs://, az://, https://, "
                                   "file://) the annotation's video names are relative to")

    @field_validator("video_root")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                check_supported(v)
            except LocationError as err:
                raise ValueError(str(err)) from None
        return v
    limit: int | None = Field(None, ge=1, description="only the first N questions (smoke runs)")
    options: dict[str, Any] = Field(default_factory=dict, description="adapter-specific settings")


class VllmConfig(_Section):
    """`model.vllm:` settings read only by `engine: vllm` (vLLM's own names and defaults)."""
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: Float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16, description="None = the checkpoint's own context length")
    enforce_eager: bool = Field(False, description="skip CUDA graph capture (faster start, slower steps)")
    max_videos_per_prompt: int = Field(1, ge=1, description="vLLM's limit_mm_per_prompt for video")
    max_num_seqs: int | None = Field(None, ge=1, description="None = vLLM's default")
    seed: int = 0


class ModelConfig(_Section):
    checkpoint: str = Field(description="Hugging Face-format checkpoint directory, or a hub id (org/name) "
                            "when no such directory exists; write ./org/name to insist on a path")
    engine: str = "mlx"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "gpu"] = Field("auto", description="auto = Metal or CUDA GPU when MLX sees one")
    min_pixels: int | None = Field(None, ge=1)
    max_pixels: int | None = Field(None, ge=1)
    max_num_batched_tokens: Literal["auto"] | Annotated[int, Field(ge=16)] = Field(
        "auto", description="tokens per forward pass (packing budget); auto = from the model and the device's "
        "memory (8192 on a CPU, up to 32768 on a GPU)")
    max_model_len: int = Field(32768, ge=16)
    memory_budget_gb: Float | None = Field(None, gt=0, description="null = sized from the engine's device")
    host_reserved_gb: Float | None = Field(
        None, ge=0, description="memory the job's other processes hold beside the engine (decoders, Ray's object "
        "store), taken off the budget where they share the device's memory (Apple silicon, CPU); null = "
        "estimated from the runtime section")
    temporal_step: Literal["nominal", "actual"] = Field(
        "nominal", description="video frame rate behind the temporal position step: nominal = n / total_frames * "
        "fps (the convention the model was trained with, as transformers and vLLM compute it); actual = the mean "
        "spacing of the frames the loader picked")
    timestamps: Literal["actual", "nominal"] = Field(
        "actual", description="Qwen3-VL's per-group time text: actual = the decoded frames' presentation times "
        "(true keyframe times); nominal = frames_indices / fps, as transformers' processor computes it")
    vllm: VllmConfig | None = Field(None, description="settings for engine: vllm (dtype is model.dtype)")

    @model_validator(mode="after")
    def _engine_settings_agree(self) -> "ModelConfig":
        # The checks the engines themselves make at load, made here so a bad value names its key up front.
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if self.vllm is not None and self.engine != "vllm":
            raise ValueError(f"model.vllm is read only by engine: vllm, but engine is {self.engine!r}; "
                             "remove it or set engine: vllm")
        if self.engine == "vllm" and self.host_reserved_gb is not None:
            raise ValueError("host_reserved_gb is read only by engine: mlx; with engine: vllm set "
                             "vllm.gpu_memory_utilization")
        if self.engine == "vllm" and self.memory_budget_gb is not None:
            raise ValueError("memory_budget_gb is read only by engine: mlx; with engine: vllm set "
                             "vllm.gpu_memory_utilization")
        return self


class LoaderConfig(_Section):
    name: str = "pyav_keyframes"
    num_frames: int = Field(16, ge=1, le=512)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class PromptConfig(_Section):
    template: str | None = Field(None, description="None = the engine's default; must contain {question} and {options}")
    system: str | None = None
    option_labels: list[str] = Field(default_factory=lambda: ["A", "B", "C", "D", "E"], min_length=2,
                                     max_length=MAX_OPTIONS)

    @field_validator("template")
    @classmethod
    def _has_placeholders(cls, v: str | None) -> str | None:
        if v is not None:
            template_problem(v)
        return v

    @field_validator("option_labels")
    @classmethod
    def _unique_labels(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not s.strip() for s in v):
            raise ValueError(f"option labels must be distinct and non-empty, got {v}")
        return v


class RemoteConfig(_Section):
    """How clips named by URLs are read (`runtime.remote:`); credentials are never set here (see README)."""
    attempts: int = Field(4, ge=1, le=20, description="tries per request for timeouts, 5xx and dropped connections")
    request_timeout_s: Float = Field(20.0, gt=0, description="one request, connection to last byte")
    read_ahead_kb: int = Field(64, ge=4, description="bytes fetched after a seek (the keyframe loaders' reads)")
    max_read_ahead_mb: Float = Field(4.0, gt=0, description="read-ahead grows to this while reads are sequential")
    download_cache_mb: Float = Field(4096.0, gt=0, description="local copies for loaders that need a file "
                                     "(opencv), per decoder process; removed when it exits")

    @model_validator(mode="after")
    def _read_ahead_grows(self) -> "RemoteConfig":
        if self.read_ahead_kb * 1024 > self.max_read_ahead_mb * 1024 * 1024:
            raise ValueError(f"read_ahead_kb ({self.read_ahead_kb}) must not exceed max_read_ahead_mb "
                             f"({self.max_read_ahead_mb:g})")
        return self


def template_problem(template: str) -> None:
    """Raise ValueError unless `template.format(question=..., options=...)` works for every row: an unknown
    placeholder would otherwise fail every row of the job with a KeyError, after the decoding was paid for."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as err:    # a lone brace
        raise ValueError(f"template is not a valid format string ({err}); write {{{{ and }}}} for literal "
                         "braces") from None
    unknown = sorted({f for f in fields if re.split(r"[.\[]", f, maxsplit=1)[0] not in TEMPLATE_FIELDS})
    if unknown:
        raise ValueError(f"template: unknown placeholder(s) {', '.join('{' + f + '}' for f in unknown)}; the "
                         "placeholders are {question} and {options} (write {{ and }} for literal braces)")
    missing = [f"{{{p}}}" for p in TEMPLATE_FIELDS if p not in fields]
    if missing:
        raise ValueError(f"template must contain {' and '.join(missing)}")
    try:
        template.format(question="q", options="A. o")
    except (KeyError, IndexError, AttributeError, ValueError, TypeError) as err:
        raise ValueError(f"template cannot be filled in ({type(err).__name__}: {err}); use plain {{question}} "
                         "and {options}") from None


class RuntimeConfig(_Section):
    decode_actors: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description="CPU decoders; auto = the CPUs Ray reports, less the engines' CPUs (at least 1)")
    engine_actors: Literal["auto"] | Annotated[int, Field(ge=1)] = Field(
        "auto", description="engine replicas (one model copy each); auto = one per GPU when the engine uses GPUs, else 1")
    engine_gpus: Literal["auto"] | Annotated[Float, Field(ge=0)] = Field(
        "auto", description="Ray num_gpus per engine replica; auto = 1 when Ray reports GPUs and model.device is "
        "not cpu, else 0")
    engine_placement: Literal["auto", "driver", "actors"] = Field(
        "auto", description="driver = the engine loads and answers in the job's own process, its load beside "
        "Ray's start (one local replica); actors = one Ray actor per replica; auto = driver for a local job with "
        "one replica on a GPU, else actors")
    decode_cpus: Float = Field(1.0, gt=0)
    engine_cpus: Float = Field(1.0, gt=0, description="also the engine's BLAS threads (at least 1): give a CPU "
                               "engine the cores it should use beside the decoders")
    frames_in_flight: int = Field(8, ge=1, description="clips decoded or being classified at once (memory bound)")
    clips_per_batch: int = Field(4, ge=1, description="clips handed to the engine per call (packing width)")
    decode_timeout_s: Float = Field(120.0, gt=0, description="a decode taking longer costs the clip an error row")
    ray_address: str | None = Field(None, description="join this Ray cluster; None = private local Ray on 127.0.0.1")
    max_error_fraction: Float = Field(0.05, ge=0, le=1, description="exit 1 when more rows than this fail")
    remote: RemoteConfig = RemoteConfig()


class OutputConfig(_Section):
    directory: str
    rows_per_part: int = Field(512, ge=1)
    flush_seconds: Float = Field(30.0, gt=0, description="a part is written at least this often while rows arrive")


class JobConfig(_Section):
    job: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    dataset: DatasetConfig
    model: ModelConfig
    loader: LoaderConfig = LoaderConfig()
    prompt: PromptConfig = PromptConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    output: OutputConfig
    source: str | None = Field(None, description="the YAML file this came from (set by load_config)")

    def fingerprint(self) -> str:
        """Hash of every setting that changes an answer, so resumed rows never mix two setups.

        Excluded on purpose: paths of the dataset (moving data must not invalidate results), limit (a
        smoke run resumes into the full run), runtime and output (they change speed, not answers).
        """
        m = self.model
        answer_inputs = {
            "dataset_adapter": self.dataset.adapter,
            "model": {"checkpoint": m.checkpoint, "engine": m.engine, "dtype": m.dtype, "device": m.device,
                      "min_pixels": m.min_pixels, "max_pixels": m.max_pixels,
                      "temporal_step": m.temporal_step, "timestamps": m.timestamps},
            "loader": self.loader.model_dump(),
            "prompt": self.prompt.model_dump(),
        }
        blob = json.dumps(answer_inputs, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def with_overrides(self, *, limit: int | None = None, output: str | None = None,
                       ray_address: str | None = None) -> "JobConfig":
        """Apply CLI flags (paths relative to the caller's working directory)."""
        upd: dict[str, Any] = {}
        if limit is not None:
            if limit < 1:
                raise ConfigError(f"--limit must be >= 1, got {limit}")
            upd["dataset"] = self.dataset.model_copy(update={"limit": limit})
        if output is not None:
            upd["output"] = self.output.model_copy(update={"directory": str(Path(output).expanduser().resolve())})
        if ray_address is not None:
            upd["runtime"] = self.runtime.model_copy(update={"ray_address": ray_address})
        return self.model_copy(update=upd)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve(base: Path, value: str) -> str:
    return str((base / Path(value).expanduser()).resolve())


def _resolve_root(base: Path, value: str | None) -> str | None:
    """A URL stays as written (file:// becomes its path); a path resolves against the config's directory."""
    if value is None:
        return None
    if is_url(value):
        try:
            return local_path(value) if scheme(value) == "file" else value
        except ValueError as err:
            raise ConfigError(f"dataset.video_root: {err}") from None
    return _resolve(base, value)


def _format_validation(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid job config:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = re.sub(r"^Value error, ", "", e["msg"])
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; see configs/nextqa.yaml for every key)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        got = e.get("input")
        got = redact(got) if is_url(got) else got   # never echo a secret written into a URL
        lines.append(f"  {key}: {msg} (got {got!r})" if e["type"] != "missing" else f"  {key}: {msg}")
    return "\n".join(lines)


DATE_PLACEHOLDER = "{date}"


def night_date(date: str | None = None) -> str:
    """The night a run belongs to: `date` checked as YYYY-MM-DD, or today's date in UTC."""
    from datetime import datetime, timezone

    if date is None:
        return datetime.now(timezone.utc).strftime("%Y-%m-%d")
    try:
        return datetime.strptime(date, "%Y-%m-%d").strftime("%Y-%m-%d")
    except ValueError:
        raise ConfigError(f"--date: expected YYYY-MM-DD, got {date!r}") from None


def _expand_date(directory: str, date: str | None, path: Path) -> str:
    """`{date}` in output.directory gives each night its own dataset; any other placeholder is a typo."""
    expanded = directory.replace(DATE_PLACEHOLDER, night_date(date)) if DATE_PLACEHOLDER in directory else directory
    stray = re.search(r"\{[^{}]*\}", expanded)
    if stray:
        raise ConfigError(f"{path}: output.directory: unknown placeholder {stray.group(0)} in {directory!r}; "
                          f"the only one is {DATE_PLACEHOLDER} (the night's date, UTC, YYYY-MM-DD)")
    return expanded


def parse_config(raw: Any, path: Path, *, date: str | None = None) -> JobConfig:
    """Validate a parsed YAML document and resolve its relative paths against `path`'s directory.

    `date` fills a `{date}` placeholder in output.directory (default: today, UTC)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a job config is a YAML mapping (job:, dataset:, model:, ...), got {type(raw).__name__}")
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation(path, err)) from None
    base = path.parent
    ds = cfg.dataset.model_copy(update={
        "annotation": _resolve(base, cfg.dataset.annotation),
        "video_root": _resolve_root(base, cfg.dataset.video_root),
    })
    ckpt = cfg.model.checkpoint
    local = base / Path(ckpt).expanduser()
    # A hub id ("Qwen/Qwen2.5-VL-7B-Instruct") stays as is unless a directory of that name sits beside the config.
    if local.exists() or not _HUB_ID.match(ckpt):
        ckpt = str(local.resolve())
    return cfg.model_copy(update={
        "dataset": ds,
        "model": cfg.model.model_copy(update={"checkpoint": ckpt}),
        "output": cfg.output.model_copy(
            update={"directory": _resolve(base, _expand_date(cfg.output.directory, date, path))}),
        "source": str(path.resolve()),
    })


def load_config(path: str | Path, *, date: str | None = None) -> JobConfig:
    """Read and validate a job YAML; raises ConfigError naming the file and key. `date`: see parse_config."""
    path = Path(path)
    if date is not None:
        night_date(date)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = read_yaml(path, "job config")
    except YamlFileError as err:
        raise ConfigError(str(err)) from None
    return parse_config(raw, path, date=date)

