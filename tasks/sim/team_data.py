"""A team's own code base as data: its files split into train and test (as data.source's are), its held-out FIM
samples and typing regions, under `paths.data_dir/teams/TEAM/` (`tabrl teams data TEAM`; a team's first cycle
writes them when they are missing). A team's gate types its own test files; a team without a source in
`teams.sources` is gated on the organisation's held-out files."""

from __future__ import annotations

from pathlib import Path

from tasks.core.config import Params
from tasks.core.teams import ORG, team_dir
from tasks.sim.corpus import read_corpus, write_corpus, write_fim
from tasks.sim.editor import regions_path


def data_dir_of(params: Params, team: str) -> Path:
    """The data dir whose `fim/` holds `team`'s held-out files: its own (it has a source), else the organisation's."""
    if team == ORG or team not in params.teams.sources:
        return Path(params.paths.data_dir)
    return team_dir(params.paths.data_dir, team)


def write_team_data(params: Params, team: str) -> dict[str, int]:
    """`team`'s corpus (corpus/files.parquet) and its FIM samples and typing regions (fim/), from its source; the
    counts. A CorpusError names a source that cannot be read."""
    if team not in params.teams.sources:
        raise ValueError(f"team {team!r} has no code base: set teams.sources.{team} (a directory, corpus or FIM set)")
    out = data_dir_of(params, team)
    data = params.data.model_copy(update={"source": params.teams.sources[team]})
    write_corpus(data, out / "corpus")
    return write_fim(data, params.fim, params.traffic, read_corpus(out / "corpus" / "files.parquet"), out / "fim")


def held_out_dir(params: Params, team: str) -> Path:
    """`data_dir_of(params, team)`, its held-out files written first when a team with a source has none yet."""
    out = data_dir_of(params, team)
    if out != Path(params.paths.data_dir) and not regions_path(out, "test").is_file():
        write_team_data(params, team)
    return out
