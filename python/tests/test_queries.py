"""Queries on a run from Python answer exactly what `legendctl predict|score|neighbors` answers
(the same crate, legend-query), as DataFrames; names are labels or ids; bad names are errors
that name them; a run is shared safely by threads."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pytest

import legend


def cli(legendctl, *args: str) -> list[dict]:
    done = subprocess.run(
        [legendctl, *map(str, args), "--json", "--device", "cpu"], check=True, capture_output=True, text=True
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


def hits(answer: dict) -> list[tuple[int, str, float]]:
    return [(h["id"], h["label"], np.float32(h["score"])) for h in answer["hits"]]


def rows(frame: pd.DataFrame, side: str) -> list[tuple[int, str, float]]:
    return list(zip(frame[f"{side}_id"], frame[f"{side}_label"], frame["score"]))


@pytest.fixture(scope="module")
def run(trained):
    with legend.open(trained[0].path, device="cpu") as r:
        yield r


def test_predict_equals_legendctl_predict(run, legendctl):
    head, relation = run.entities[7], run.relations[3]
    for filtered in (True, False):
        flag = ["--filtered"] if filtered else []
        want = cli(legendctl, "predict", run.path, "--head", head, "--relation", relation, "--top", 10, *flag)
        got = run.predict(head=head, relation=relation, k=10, filtered=filtered)
        assert rows(got, "tail") == hits(want[0])
        assert list(got["rank"]) == list(range(1, 11))
        assert set(got["head_label"]) == {head} and set(got["relation_id"]) == {3}
        assert got.attrs["filtered"] is filtered
        assert got["score"].dtype == np.float32
    tail = run.entities[11]
    want = cli(legendctl, "predict", run.path, "--tail", tail, "--relation", relation, "--top", 5, "--filtered")
    got = run.predict(tail=tail, relation=relation, k=5)
    assert rows(got, "head") == hits(want[0])


def test_score_and_neighbors_equal_legendctl(run, legendctl, tmp_path):
    triples = run.triples("test").head(20)
    path = tmp_path / "triples.tsv"
    path.write_text("".join(f"{h}\t{r}\t{t}\n" for h, r, t in triples.itertuples(index=False)))
    want = cli(legendctl, "score", run.path, path)
    got = run.score(triples)
    assert list(got["score"]) == [np.float32(a["score"]) for a in want]
    assert list(got["head_label"]) == list(triples["head"])
    for metric in ("cosine", "dot", "l2"):
        entity = run.entities[5]
        want = cli(legendctl, "neighbors", run.path, "--entity", entity, "--metric", metric, "--top", 8)
        got = run.neighbors(entity, k=8, metric=metric)
        assert rows(got, "neighbor") == hits(want[0])


def test_ids_and_labels_name_the_same_things_and_batches_number_their_queries(run):
    by_label = run.predict(head=run.entities[2], relation=run.relations[0])
    by_id = run.predict(head=2, relation=np.int64(0))
    pd.testing.assert_frame_equal(by_label, by_id)
    batch = run.predict(head=[2, 3, 4], relation=0, k=4)
    assert list(batch["query"]) == [0] * 4 + [1] * 4 + [2] * 4
    assert list(batch["head_id"].unique()) == [2, 3, 4]
    pd.testing.assert_frame_equal(
        batch[batch["query"] == 0].drop(columns="query").reset_index(drop=True),
        run.predict(head=2, relation=0, k=4),
    )
    ids = np.array([[2, 0, 5], [3, 1, 6]])
    assert list(run.score(ids)["tail_id"]) == [5, 6]
    assert len(run.neighbors([1, 2], k=3)) == 6


def test_unknown_names_and_bad_queries_are_errors_that_name_them(run):
    with pytest.raises(legend.UnknownNameError, match="no-such-entity") as e:
        run.predict(head="no-such-entity", relation=0)
    assert isinstance(e.value, KeyError) and "no-such-entity" in str(e.value)
    with pytest.raises(legend.UnknownNameError, match="relation id 999"):
        run.predict(head=0, relation=999)
    with pytest.raises(ValueError, match="not both"):
        run.predict(head=0, relation=0, tail=1)
    with pytest.raises(ValueError, match="at least one"):
        run.predict(head=0, relation=0, k=0)
    with pytest.raises(ValueError, match="metric"):
        run.neighbors(0, metric="manhattan")
    with pytest.raises(ValueError, match="different lengths"):
        run.predict(head=[0, 1], relation=[0, 1, 2])
    with pytest.raises(ValueError, match="triple 2"):
        run.score([(0, 0, 1), (0, 1)])


def test_threads_share_a_run_and_get_the_answers_of_one(run):
    heads = list(range(40))
    alone = [run.predict(head=h, relation=h % len(run.relations), k=5) for h in heads]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda h: run.predict(head=h, relation=h % len(run.relations), k=5), heads))
    for a, b in zip(alone, together):
        pd.testing.assert_frame_equal(a, b)


def test_a_closed_run_answers_nothing_but_its_arrays_stay(trained):
    r = legend.open(trained[0].path, device="cpu")
    r.predict(head=0, relation=0)
    vectors = r.embeddings()
    r.close()
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.predict(head=0, relation=0)
    with pytest.raises(ValueError, match="closed"):
        r.embeddings()
    assert float(np.abs(vectors).sum()) > 0


def test_a_k_past_the_entities_asks_for_all_of_them(run):
    everyone = len(run.entities)
    for k in (everyone + 1, 2**70):
        got = run.predict(head=0, relation=0, k=k, filtered=False)
        assert list(got["rank"]) == list(range(1, everyone + 1))
    assert len(run.neighbors(0, k=2**64)) == everyone - 1
