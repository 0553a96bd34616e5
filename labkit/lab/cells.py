"""A notebook's parameters cell: one typed literal per line, `name: type = literal  # comment`,
read without running the notebook (`notebook_parameters`), each value read as its declared
type, or as the TrainConfig field of its name (`read_parameter`). The runner, the sweeps and
labkit.lab.model_params read notebooks through it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from labkit.settings.config import TrainConfig, field_types
from labkit.settings.fields import parse, parse_field

PARAM_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
RUNNER_OWNED = "run_dir"


@dataclass(frozen=True)
class Param:
    """One line of a parameters cell: `name: type = default  # comment`."""

    type: type
    default: int | float | str | bool
    comment: str


def read_notebook(path: str | Path):
    import nbformat

    path = Path(path)
    if path.suffix != ".ipynb":
        raise ValueError(f"{path} is not a notebook (.ipynb)")
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as e:  # nbformat raises several unrelated types for a broken file
        raise ValueError(f"{path} is not a readable notebook: {e}") from None


def parameters_source(path: str | Path) -> str:
    """The source of the notebook's one code cell tagged `parameters`."""
    cells = [c for c in read_notebook(path).cells
             if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1 or cells[0].cell_type != "code":
        found = f"{len(cells)} cells" if len(cells) != 1 else "a markdown cell"
        raise ValueError(f"{Path(path).name} needs exactly one code cell tagged 'parameters', "
                         f"found {found}")
    return cells[0].source


def notebook_parameters(path: str | Path) -> dict[str, Param]:
    """Name -> Param of the parameters cell, whose every statement must be a typed literal,
    `name: type = literal  # comment` with type int, float, str or bool."""
    name = Path(path).name
    source = parameters_source(path)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"{name}: the parameters cell is not valid Python ({e.msg}, "
                         f"line {e.lineno})") from None
    lines = source.splitlines()
    found: dict[str, Param] = {}
    for node in tree.body:
        where = f"{name}: parameters cell line {node.lineno}"
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.value is not None):
            raise ValueError(f"{where} is not `name: type = literal  # comment`: "
                             f"{ast.unparse(node)[:60]!r}")
        key = node.target.id
        kind = node.annotation.id if isinstance(node.annotation, ast.Name) else None
        if kind not in PARAM_TYPES:
            raise ValueError(f"{where}: {key} has type {ast.unparse(node.annotation)!r}; "
                             f"a parameter is one of {', '.join(PARAM_TYPES)}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ValueError(f"{where}: {key} = {ast.unparse(node.value)[:60]} is not a literal"
                             ) from None
        if key in found:
            raise ValueError(f"{where}: {key} is defined twice")
        last = lines[node.end_lineno - 1].encode()[node.end_col_offset:].decode().strip()
        if isinstance(value, str) and PARAM_TYPES[kind] is not str:
            raise ValueError(f"{where}: {key} is {kind}, got {value!r} (str)")
        found[key] = Param(PARAM_TYPES[kind], read_parameter(key, value, PARAM_TYPES[kind], name),
                           last.lstrip("#").strip() if last.startswith("#") else "")
    return found


def papermill_view(path: str | Path) -> None:
    """Raise ValueError unless `papermill --help-notebook` lists every parameter with its type:
    papermill reads the cell with a regex and skips a line holding more than one '=' (in the
    value or the comment: '>=', 'a=b')."""
    from papermill.translators import PythonTranslator

    seen = {p.name: p.inferred_type_name
            for p in PythonTranslator.inspect({"source": parameters_source(path)})}
    missed = [f"{key} ({param.type.__name__})" for key, param in notebook_parameters(path).items()
              if seen.get(key) != param.type.__name__]
    if missed:
        raise ValueError(f"{Path(path).name}: papermill --help-notebook does not list "
                         f"{', '.join(missed)}; keep each on one line with a single '=' "
                         "(none in the value or the comment)")


def read_parameter(name: str, value, kind: type, notebook: str | Path = ""):
    """A parameter's value, as text (`run -p`) or as YAML gives it (a sweep), read as the
    declared type `kind` by `labkit.settings.fields.parse`, the reader of every entry point; a
    parameter named and typed like a `TrainConfig` field is read as that field (`lr` takes
    `none`, `estimator` its choice `none`). ValueError names the parameter and the notebook."""
    who = f"parameter {name}" + (f" of {Path(notebook).name}" if notebook else "")
    if name != RUNNER_OWNED and field_types().get(name) is kind:
        return parse_field(TrainConfig, name, value, who)
    return parse(value, kind, who)


def unknown_names(notebook: str | Path, names, params: dict[str, Param]) -> None:
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ValueError(f"{Path(notebook).name} has no parameter {', '.join(unknown)}; its "
                         f"parameters are {', '.join(params)}")
