"""TrainConfig's fields as command-line options: one config, one place.

`SETTINGS` lists one `Setting` per option: every TrainConfig field, and for a nested model field (`anytime`) a flag
that turns it on plus one option per sub-field (`--anytime-k`). Each option's name, help (the field's description),
bound and default come from the field itself; its value is validated by a pydantic TypeAdapter over the field's own
annotation and constraints (so `--eps` refuses what `ProbeEps` refuses, with the same message). `with_settings`
adds them to a typer command as generated parameters (a signature built from SETTINGS), and `parse_set` reads
`up --set KEY=VALUE` with the same names and the same validation. A new TrainConfig field becomes an option of
`train` (and `up`) with no other edit; other models (trainer.run_options.RunOptions, probe_worker.options.WorkerOptions)
are generated the same way.

A field may say more about its option in `json_schema_extra` (`cli_extra`): "envvar" (a variable, or a list of them,
read when the option is not given), "repeat" (a tuple field as a repeatable option named without its plural "s":
`teacher_queues` is `--teacher-queue`), "name" (another option name), "help" (help text other than the description),
"metavar" (the value's name in --help, e.g. KEY=VALUE), "hidden" (left out of --help, still accepted).
A nested model field may also give "options" ({sub-field: those keys, or None to leave it out}: how its sub-fields,
declared in a model owned elsewhere, are spelled as options) and "switch": False (no flag turns it on: any of its
sub-options does).

Torch-free: imported when the CLI is built.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import annotated_types as at
import typer
from pydantic import AllowInfNan, BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from trainer.config import RUN_PRESETS, TrainConfig

M = TypeVar("M", bound=BaseModel)

# The section of --help that lists them (the command's own options come first, under "Options").
SECTION = "Training settings (TrainConfig; `up --set KEY=VALUE` takes the same names)"


@dataclass(frozen=True)
class Setting:
    """One generated option. `path` is where its value goes in TrainConfig's keyword arguments: ("lr",), or
    ("anytime", "k") for a sub-field; ("anytime",) with `flag` set is the switch that turns a nested model on with
    its defaults. `info` is the pydantic FieldInfo it is generated from."""

    name: str
    path: tuple[str, ...]
    info: FieldInfo
    flag: bool = False
    envvar: str | tuple[str, ...] | None = None
    repeat: bool = False
    doc: str | None = None
    metavar: str | None = None
    hidden: bool = False

    @property
    def option(self) -> str:
        """The option's flag, e.g. "--seq-len" (a dict field `X_options` is the repeatable "--X-option")."""
        return "--" + self.name.replace("_", "-")

    @property
    def is_dict(self) -> bool:
        return _is_dict(self.info)

    @functools.cached_property
    def adapter(self) -> TypeAdapter:
        """Validates one value exactly as TrainConfig does (the field's annotation and constraints); a float is
        finite first ("Input should be a finite number", as TrainConfig's allow_inf_nan=False says, before a bound)."""
        meta = tuple(self.info.metadata)
        if _bare(self.info.annotation) is float:
            meta = (AllowInfNan(False), *meta)
        return TypeAdapter(Annotated[(self.info.annotation, *meta)] if meta else self.info.annotation)

    def parse(self, text: Any) -> Any:
        """The option's value from its command-line text (or an already typed value). A tuple field takes a comma
        list ("1,2,4"; `comma_items`), a bool "true"/"false". Raises ValueError (pydantic's ValidationError) as
        TrainConfig would, or for an empty item of a comma list."""
        if self.flag:
            return TypeAdapter(bool).validate_python(text)
        if isinstance(text, str) and get_origin(_bare(self.info.annotation)) is tuple:
            text = comma_items(text)
        return self.adapter.validate_python(text)


def comma_items(text: str) -> list[str]:
    """A comma list's items ("1, 2,4" -> ["1", "2", "4"]; "" -> []). Raises ValueError for an empty item ("1,,2",
    "1,2,"): every tuple option refuses it, never drops it."""
    items = [t.strip() for t in text.split(",")] if text.strip() else []
    if "" in items:
        raise ValueError(f"{text!r} has an empty item: separate the values by single commas")
    return items


def _bare(annotation: Any) -> Any:
    """`annotation` without `| None`."""
    if get_origin(annotation) in (Union, getattr(__import__("types"), "UnionType", Union)):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _nested(annotation: Any) -> type[BaseModel] | None:
    bare = _bare(annotation)
    return bare if isinstance(bare, type) and issubclass(bare, BaseModel) else None


def cli_extra(info: FieldInfo) -> dict[str, Any]:
    """What a field says about its option beyond its type (module docstring): its `json_schema_extra` dict, or {}."""
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _setting(name: str, path: tuple[str, ...], info: FieldInfo, given: dict[str, Any]) -> Setting:
    cli = {**cli_extra(info), **given}
    envvar = cli.get("envvar")
    name = cli.get("name") or (name.removesuffix("s") if _is_dict(info) or cli.get("repeat") else name)
    return Setting(name, path, info, envvar=tuple(envvar) if isinstance(envvar, list) else envvar,
                   repeat=bool(cli.get("repeat")), doc=cli.get("help"), metavar=cli.get("metavar"),
                   hidden=bool(cli.get("hidden")))


def _settings(model: type[BaseModel] = TrainConfig) -> tuple[Setting, ...]:
    out: list[Setting] = []
    for name, info in model.model_fields.items():
        sub = _nested(info.annotation)
        if sub is None:
            out.append(_setting(name, (name,), info, {}))
            continue
        cli = cli_extra(info)
        if cli.get("switch", True):
            out.append(Setting(name, (name,), info, flag=True))
        spelled = cli.get("options", {})
        out += [_setting(f"{name}_{k}", (name, k), v, spelled.get(k) or {}) for k, v in sub.model_fields.items()
                if k not in spelled or spelled[k] is not None]
    return tuple(out)


def _is_dict(info: FieldInfo) -> bool:
    return get_origin(_bare(info.annotation)) is dict


SETTINGS: tuple[Setting, ...] = _settings()
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def bounds(info: FieldInfo) -> dict[str, float]:
    """The numeric bounds a field declares ({"gt": 0.0, "le": 1.0}, ...), read from its pydantic metadata."""
    out: dict[str, float] = {}
    for m in info.metadata:
        if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le, at.Interval)):
            out.update({k: getattr(m, k) for k in ("gt", "ge", "lt", "le") if getattr(m, k, None) is not None})
    return out


def _bound_text(info: FieldInfo) -> str:
    b = {k: f"{v:,}" if isinstance(v, int) and abs(v) >= 10_000 else f"{v:g}" for k, v in bounds(info).items()}
    lo = f"{b['gt']}<" if "gt" in b else f"{b['ge']}<=" if "ge" in b else ""
    hi = f"<{b['lt']}" if "lt" in b else f"<={b['le']}" if "le" in b else ""
    return f"{lo}x{hi}" if lo or hi else ""


def _metavar(s: Setting) -> str:
    ann = _bare(s.info.annotation)
    if s.metavar:
        return s.metavar
    if s.is_dict:
        return "KEY=VALUE"
    if get_origin(ann) is Literal:
        return "[" + "|".join(map(str, get_args(ann))) + "]"
    if get_origin(ann) is tuple:
        return "A,B,..."
    name = getattr(ann, "__name__", "TEXT")
    return {"int": "INTEGER", "float": "FLOAT", "str": "TEXT", "Path": "PATH"}.get(name, "TEXT")


def _shown(default: Any) -> str:
    """A default as --help shows it: on/off, none (unset or empty), a comma list, else its text; a text that would
    read as one of those (the choice "none", an empty text) in double quotes: `--serving [none|vllm]` shows
    `"none"`, never the `none` of an option with no default."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default in ({}, ()):
        return "none"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return f'"{default}"' if isinstance(default, str) and default.strip().lower() in ("", "none") else str(default)


def _preset_default(s: Setting) -> str:
    """The default shown in --help (`_shown`): TrainConfig's, and the demo run preset's when it sets another."""
    if s.flag:
        return "off"
    default = None if s.info.is_required() else s.info.get_default(call_default_factory=True)
    shown = _shown(default)
    own = len(s.path) == 1 and TrainConfig.model_fields.get(s.path[0]) is s.info  # other models: no demo preset
    demo = RUN_PRESETS["demo"].get(s.path[0]) if own else None
    return f"{shown}; demo preset: {demo}" if demo is not None and demo != default else shown


def _help(s: Setting) -> str:
    if s.flag:
        return (f"Turn on {s.info.description or s.name} with its defaults (any --{s.name.replace('_', '-')}-* "
                "option turns it on too).")
    text = s.doc or s.info.description or s.name.replace("_", " ")
    if s.is_dict:
        text += " (repeatable; VALUE read as JSON, else text)"
    elif s.repeat:
        text += " (repeatable)"
    bound = _bound_text(s.info)
    return f"{text}{'.' if not text.endswith('.') else ''}{f' Bound: {bound}.' if bound else ''}"


def _parameter(s: Setting) -> inspect.Parameter:
    """The typer parameter of one setting: default None (the preset's / TrainConfig's value), its value parsed
    and validated by `Setting.parse` (a dict field: KEY=VALUE pairs, repeatable)."""
    ann = _bare(s.info.annotation)
    required = s.info.is_required() and len(s.path) == 1  # a sub-field is required only once its model is on
    envvar = list(s.envvar) if isinstance(s.envvar, tuple) else s.envvar
    common = dict(help=_help(s), show_default=not required and _preset_default(s), envvar=envvar, hidden=s.hidden)
    unset = ... if required else None
    if s.flag or ann is bool:
        return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation=bool | None,
                                 default=typer.Option(unset, f"{s.option}/--no-{s.option[2:]}", **common))
    if s.is_dict or s.repeat:
        return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation=list[str] | None,
                                 default=typer.Option(unset, s.option, metavar=s.metavar or
                                                      ("KEY=VALUE" if s.is_dict else "TEXT"), **common))
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, annotation=Any,
                             default=typer.Option(unset, s.option, metavar=_metavar(s), parser=s.parse, **common))


def key_values(items: list[str], option: str = "--optimizer-option") -> dict:
    """KEY=VALUE pairs as a dict; VALUE is read as JSON (8, 0.5, true, null) or else kept as text (block). The
    model validates them. Raises typer.BadParameter (naming `option`) for an item without '=' or a KEY given twice
    (as `--set` refuses one: the later value silently won)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        if key.strip() in out:
            raise typer.BadParameter(f"{key.strip()} given twice", param_hint=option)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def collect(values: dict[str, Any], by_name: dict[str, Setting] | None = None) -> dict[str, Any]:
    """Model keyword overrides (TrainConfig's unless `by_name` is another model's table, `table`) from generated
    options' values {setting name: value}; None (unset) is left out; a nested model's sub-fields (or its flag) build
    its dict ({"anytime": {"k": 4}})."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        s = (by_name or BY_NAME)[name]
        if value is None or ((s.is_dict or s.repeat or s.flag) and not value):
            continue
        if s.is_dict:
            value = key_values(list(value), s.option) if isinstance(value, (list, tuple)) else dict(value)
        elif s.repeat:
            value = tuple(value)
        if len(s.path) == 1:
            if s.flag:
                out.setdefault(s.path[0], {})
            else:
                out[s.path[0]] = value
        else:
            out.setdefault(s.path[0], {})[s.path[1]] = value
    return out


def table(model: type[BaseModel]) -> dict[str, Setting]:
    """{option name: Setting} of `model`'s fields (TrainConfig's is BY_NAME)."""
    return BY_NAME if model is TrainConfig else {s.name: s for s in _settings(model)}


def parse_set(items: tuple[str, ...] | list[str], *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """{setting name: typed value} from "KEY=VALUE" strings (`up --set`): KEY is an option's name (dashes or
    underscores: lr, seq-len, anytime_k, optimizer_option), VALUE validated as that option's. Raises ValueError for an
    item without "=", an unknown or excluded KEY, a KEY given twice, or a value the field refuses (naming it)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: use KEY=VALUE, e.g. --set lr=6e-4")
        s = BY_NAME.get(key)
        if s is None or key in exclude or s.path[0] in exclude:
            raise ValueError(f"--set {key}: not a setting of both runs; settable: "
                             f"{', '.join(n for n, x in BY_NAME.items() if n not in exclude and x.path[0] not in exclude)}")
        if key in out and not s.is_dict:
            raise ValueError(f"--set {key} given twice")
        try:
            if s.is_dict:
                out.setdefault(key, []).append(value.strip())
            else:
                out[key] = s.parse(value.strip())
        except ValueError as exc:
            raise ValueError(f"--set {key}={value.strip()}: {explain(exc)}") from None
    return out


class SettingsCommand(TyperCommand):
    """A typer command whose --help lists its positional arguments under "Arguments" (as typer's own help does),
    each model's generated options in a section of its own (`with_settings`' `section`), after the command's own
    options, each default shown bare (`_plain_default`). Its help is click's
    plain one whatever its app's rich_markup_mode: rich's tables know neither the sections nor the bare defaults (a
    group invoked on its own, `bench_app`, showed `[default: (20)]`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections = list(getattr(self.callback, "sections", ()))
        where = {name: title for title, names in sections for name in names}
        rows: dict[str, list] = {"Arguments": [], "Options": [], **{title: [] for title, _ in sections}}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = "Arguments" if param.param_type_name == "argument" else where.get(param.name, "Options")
                rows[title].append(_plain_default(param, record))
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def _plain_default(param: Any, record: tuple[str, str]) -> tuple[str, str]:
    """`record` (an option's --help row) with the default its generator gave as text shown bare: click shows a
    `show_default` text in parentheses, as if it were a description ("[default: (20)]"), while a generated option's
    default is None (unset: the model's or preset's value) and its `show_default` the value itself (`_preset_default`):
    "[default: 20]", as click shows a plain default."""
    shown = getattr(param, "show_default", None)
    if not isinstance(shown, str):
        return record
    return record[0], record[1].replace(f"default: ({shown})", f"default: {shown}", 1)


def with_settings(*, exclude: tuple[str, ...] = (), model: type[BaseModel] = TrainConfig, param: str = "settings",
                  section: str = SECTION) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a typer command `func(<param>, **own_options)`: the command gets one option per field of `model`
    (TrainConfig by default; those of fields in `exclude`, and those whose name `func` declares itself, left out)
    after its own, and `func` receives `<param>`, the `model` overrides given (`collect`). Decorators stack: one per
    model, each listing its options in its own --help `section`. Register the result with `cls=SettingsCommand`."""
    by_name = table(model)

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func, eval_str=True)
        own = [p for name, p in sig.parameters.items() if name != param]
        taken = {p.name for p in own}
        names = [n for n, s in by_name.items() if n not in taken and s.path[0] not in exclude]
        generated = [_parameter(by_name[n]) for n in names]

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            values = {n: kwargs.pop(n) for n in names}
            return func(**{param: collect(values, by_name)}, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + generated
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the generated signature, not func's
        command.sections = (*getattr(func, "sections", ()), (section, tuple(names)))  # type: ignore[attr-defined]
        return command

    return wrap


def build(model: type[M], given: dict[str, Any]) -> M:
    """`model` from a command's generated option values (`with_settings`' dict); raises typer.BadParameter (exit 2)
    with the validators' message, naming the option (`explain`), for what the model refuses: each value was already
    checked on its own when the command line was parsed, so what is left are the rules between options."""
    from pydantic import ValidationError

    try:
        return model(**given)
    except ValidationError as exc:
        raise typer.BadParameter(explain(exc, model)) from None


def explain(exc: Exception, model: type | None = None) -> str:
    """A pydantic ValidationError as "--option: reason; ..." (CLI spelling, without pydantic's "Value error, "
    prefix, an item's index left out); other errors as str(exc). `model`: the options model the errors come from,
    whose fields are named as their generated options (trainer.cli_settings: `teacher_queues` is --teacher-queue)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    names = _option_names(model)

    def where(loc: tuple) -> str:
        path = tuple(str(p) for p in loc if not isinstance(p, int))  # ("workers", 1): the option, not its item
        return names.get(path) or "--" + "-".join(path).replace("_", "-")

    def msg(e: dict) -> str:  # a validator's ValueError comes as "Value error, <its message>": the message alone
        return str(e["msg"]).removeprefix("Value error, ")

    return "; ".join(f"{where(e['loc'])}: {msg(e)}" if e["loc"] else msg(e) for e in errors(include_url=False))


def _option_names(model: type | None) -> dict[tuple[str, ...], str]:
    """{field path: its option} of `model`'s generated options ({} without a model)."""
    if model is None:
        return {}
    return {s.path: s.option for s in table(model).values() if not s.flag}
