"""``rpcps data ratings``: generated samples shaped like public movie-rating data (MovieLens-1M:
6,040 users, 3,706 movies, 18 genres, a movie's one to three genres, a user's gender, occupation
and age, a movie's year), written as CSV with a header, to try a model over a schema on.

A sample is (user, movie) with ``label`` 1 when the user liked it (rated 4 or more: about 57 % of
MovieLens-1M's ratings). The label is drawn from a hidden logistic model: a bias per user and per
movie, a user's taste for each genre, and mild effects of age and year; the summary printed gives
that model's own AUC on the samples (``oracle_auc``), the best any model could reach. Every draw
comes from ``--seed``, so the same arguments write the same files.

Columns: ``label,user_id,movie_id,genres,gender,occupation,age,year`` (genres joined by ``|``), or
with ``--format parquet`` the same columns in Parquet files, genres a list column of strings.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")
AGES = (1, 18, 25, 35, 45, 50, 56)           # MovieLens-1M's age groups
COLUMNS = ("label", "user_id", "movie_id", "genres", "gender", "occupation", "age", "year")
LIKED = 0.57                                  # MovieLens-1M's share of ratings of 4 or 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, required=True, help="samples (lines) to write in all")
    p.add_argument("--out", type=Path, required=True, help="folder to write the files into (made if missing)")
    p.add_argument("--files", type=int, default=1, help="split the lines over this many files (part_0, part_1, …)")
    p.add_argument("--gzip", action="store_true", help="write part_K.csv.gz instead of part_K.csv")
    p.add_argument("--format", choices=("csv", "parquet"), default="csv",
                   help="csv (a header line, genres joined by |), or parquet (genres a list column)")
    p.add_argument("--row-group", type=int, default=8192, help="parquet: records a row group holds (the unit the "
                                                               "trainers divide)")
    p.add_argument("--users", type=int, default=6040, help="distinct users")
    p.add_argument("--movies", type=int, default=3706, help="distinct movies")
    p.add_argument("--seed", type=int, default=1, help="which data set (its hidden model and samples)")


def generate(rows: int, users: int, movies: int, seed: int):
    """The samples, as columns (numpy arrays; genres as strings), and ``p``: each one's probability
    of a like under the hidden model."""
    import numpy as np

    g = np.random.default_rng(seed)
    n_genres = len(GENRES)
    # Each movie: one to three genres, a year, a bias; each user: a taste per genre, a bias, traits.
    movie_genres = [sorted(g.choice(n_genres, size=g.integers(1, 4), replace=False)) for _ in range(movies)]
    movie_year = g.integers(1919, 2001, size=movies)
    movie_bias = g.normal(0.0, 0.8, size=movies)
    taste = g.normal(0.0, 1.0, size=(users, n_genres))
    user_bias = g.normal(0.0, 0.6, size=users)
    gender = g.choice(np.array(["F", "M"]), size=users, p=[0.28, 0.72])
    occupation = g.integers(0, 21, size=users)
    age = g.choice(np.array(AGES), size=users, p=[0.04, 0.18, 0.35, 0.2, 0.08, 0.08, 0.07])
    # Who rates what: a few users and movies rate far more than the rest, as in the real data.
    user = np.minimum((g.pareto(1.2, size=rows) * users / 20).astype(np.int64), users - 1)
    movie = np.minimum((g.pareto(1.0, size=rows) * movies / 30).astype(np.int64), movies - 1)
    user, movie = g.permutation(users)[user], g.permutation(movies)[movie]
    affinity = np.array([taste[u, movie_genres[m]].mean() for u, m in zip(user, movie)])
    z = user_bias[user] + movie_bias[movie] + 0.9 * affinity + 0.01 * (age[user] - 30) - 0.01 * (movie_year[movie] - 1990)
    z += np.log(LIKED / (1 - LIKED)) - z.mean()
    p = 1.0 / (1.0 + np.exp(-z))
    label = (g.random(rows) < p).astype(np.int64)
    genres = np.array(["|".join(GENRES[k] for k in movie_genres[m]) for m in range(movies)])[movie]
    return {"label": label, "user_id": user + 1, "movie_id": movie + 1, "genres": genres, "gender": gender[user],
            "occupation": occupation[user], "age": age[user], "year": movie_year[movie], "p": p}


def write_parquet(path: Path, columns: dict, start: int, stop: int, row_group: int) -> None:
    """Samples ``start`` to ``stop`` as a Parquet file: the CSV's columns, genres a list of strings;
    written beside ``path`` and renamed into place, as a file landing in a followed folder must be."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: pa.array([g.split("|") for g in columns[c][start:stop]], type=pa.list_(pa.string()))
                      if c == "genres" else columns[c][start:stop] for c in COLUMNS})
    partial = path.with_name(f".{path.name}.partial")
    pq.write_table(table, partial, row_group_size=row_group)
    partial.rename(path)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rpcps.quality import auc

    if args.format == "parquet" and args.gzip:
        print("rpcps data ratings: --gzip is for csv; Parquet files compress their own columns", file=sys.stderr)
        return 2
    if args.rows < 1 or args.files < 1 or args.files > args.rows or args.users < 1 or args.movies < 1 or \
            args.row_group < 1:
        print("rpcps data ratings: --rows, --users, --movies and --row-group must be at least 1, --rows at least "
              "--files",
              file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"rpcps data ratings: cannot make {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    started = time.monotonic()
    columns = generate(args.rows, args.users, args.movies, args.seed)
    bounds = np.linspace(0, args.rows, args.files + 1).astype(np.int64)
    files = []
    for k in range(args.files):
        if args.format == "parquet":
            path = args.out / f"part_{k}.parquet"
            write_parquet(path, columns, bounds[k], bounds[k + 1], args.row_group)
        else:
            path = args.out / (f"part_{k}.csv.gz" if args.gzip else f"part_{k}.csv")
            with (gzip.open(path, "wt", encoding="utf-8") if args.gzip else open(path, "w", encoding="utf-8")) as f:
                f.write(",".join(COLUMNS) + "\n")
                for i in range(bounds[k], bounds[k + 1]):
                    f.write(",".join(str(columns[c][i]) for c in COLUMNS) + "\n")
        files.append({"path": str(path), "lines": int(bounds[k + 1] - bounds[k]), "bytes": path.stat().st_size})
    print(json.dumps({"data": "ratings", "rows": args.rows, "files": files, "seed": args.seed,
                      "positives": round(float(columns["label"].mean()), 4),
                      "oracle_auc": round(auc(columns["p"], columns["label"]), 4),
                      "seconds": round(time.monotonic() - started, 2)}), flush=True)
    return 0
