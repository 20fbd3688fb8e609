"""Preference records as packed pair rows kept on disk: bad records (two answers of the same
tokens among them) refused or counted, pairs too long for a row dropped and counted, rows kept
and read back, a damaged file made anew."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainrun.config import RecordsData
from trainrun.data.errors import DataError
from trainrun.data.pair_rows import CHOSEN, REJECTED
from trainrun.data.preference_rows import preference_rows


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))


def _pairs_file(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _good(i: int) -> str:
    return json.dumps({"prompt": f"q{i} ", "chosen": "yes", "rejected": "no"})


def _section(path: Path, **changes: object) -> RecordsData:
    settings: dict[str, object] = {"eval_fraction": 0.0, **changes}
    return RecordsData(paths=(str(path),), format="preference", tokenizer="bytes", seq_len=63,
                       **settings)  # type: ignore[arg-type]


def test_pairs_are_packed_with_their_answers_marked(tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [_good(i) for i in range(6)])
    train, held, files = preference_rows(_section(source), 512, 0)
    rows = train.train
    assert rows is not None and held is None and train.eval is None
    assert list(files) == [str(source)] and files[str(source)].startswith("sha256:")
    assert train.counts.examples == 6 and rows["tokens"].shape[1] == 64
    chosen = rows["tokens"][rows["answer"] == CHOSEN]
    rejected = rows["tokens"][rows["answer"] == REJECTED]
    assert bytes(chosen[:3].astype(np.uint8)) == b"yes"  # the first pair's chosen answer
    assert bytes(rejected[:2].astype(np.uint8)) == b"no"
    assert int(rows["pair_slot"].max()) > 1  # short pairs share a row


def test_a_bad_record_is_one_line_naming_file_and_line_or_skipped_and_counted(
        tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [
        _good(0), "{not json", json.dumps({"prompt": "q", "chosen": "a"}), _good(3)])
    with pytest.raises(DataError) as err:
        preference_rows(_section(source), 512, 0)
    assert f"record {source}:2:" in str(err.value) and "data.bad_records=skip" in str(err.value)
    assert "\n" not in str(err.value)
    train, _, _ = preference_rows(_section(source, bad_records="skip"), 512, 0)
    assert (train.counts.records, train.counts.skipped, train.counts.examples) == (4, 2, 2)
    assert train.counts.bad[1].startswith(f"{source}:3: ") and "chosen" in train.counts.bad[1]


def test_pairs_too_long_are_dropped_and_truncation_is_counted(tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [
        _good(0), json.dumps({"prompt": "p" * 70, "chosen": "c", "rejected": "r"})])
    train, _, _ = preference_rows(_section(source), 512, 0)
    assert (train.counts.examples, train.counts.dropped) == (1, 1)
    train, _, _ = preference_rows(_section(source), 20, 2)
    assert (train.counts.examples, train.counts.dropped) == (2, 0)
    assert (train.truncated.prompts_cut, train.truncated.completions_cut) == (1, 1)  # yes<eos>


def test_kept_rows_are_read_back_and_a_flipped_byte_makes_them_anew(tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [_good(i) for i in range(20)])
    first, _, _ = preference_rows(_section(source, eval_fraction=0.25), 512, 0)
    assert first.eval is not None and first.counts.held_records == 5
    again, _, _ = preference_rows(_section(source, eval_fraction=0.25), 512, 0)
    assert again.folder == first.folder and again.notice is None
    kept = first.folder / "train.tokens.bin"
    written = kept.read_bytes()
    data = bytearray(written)
    data[3] ^= 0xFF
    kept.write_bytes(bytes(data))
    remade, _, _ = preference_rows(_section(source, eval_fraction=0.25), 512, 0)
    assert remade.notice is not None
    assert "train.tokens.bin does not match its sha256" in remade.notice
    assert kept.read_bytes() == written  # made anew, as first written


def test_pairs_under_other_field_names_are_read_as_data_fields_names_them(
        tmp_path: Path) -> None:
    plain = _pairs_file(tmp_path / "plain.jsonl", [_good(i) for i in range(4)])
    renamed = _pairs_file(tmp_path / "renamed.jsonl", [
        json.dumps({"question": f"q{i} ", "response_j": "yes", "response_k": "no",
                    "chosen": "not the answer"}) for i in range(4)])
    fields = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    want = preference_rows(_section(plain), 512, 0)[0].train
    got = preference_rows(_section(renamed, fields=fields), 512, 0)[0].train
    assert want is not None and got is not None
    for name in want:
        assert np.array_equal(want[name], got[name]), name
    # the same file under the default names is not a pair: named by the record's own names
    with pytest.raises(DataError) as err:
        preference_rows(_section(renamed), 512, 0)
    assert "has no 'chosen' and 'rejected' fields" in str(err.value)
    broken = _pairs_file(tmp_path / "broken.jsonl", [
        json.dumps({"question": "q", "response_j": 3, "response_k": "no"})])
    with pytest.raises(DataError) as err:
        preference_rows(_section(broken, fields=fields), 512, 0)
    assert "field 'response_j' is a number, not a string" in str(err.value)
    # swapping the answers' names is another cache entry: the answers swap
    swapped = preference_rows(_section(renamed, fields={**fields, "chosen": "response_k",
                                                        "rejected": "response_j"}), 512, 0)[0]
    assert swapped.train is not None
    assert bytes(swapped.train["tokens"][swapped.train["answer"] == CHOSEN][:2]
                 .astype(np.uint8)) == b"no"


def _same(i: int) -> str:
    return json.dumps({"prompt": f"q{i} ", "chosen": "same", "rejected": "same"})


def test_a_pair_whose_answers_are_the_same_tokens_is_a_bad_record(tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [
        _good(0), _same(1), _good(2), _same(3), _good(4),
        json.dumps({"prompt": "q5 ", "chosen": "yes!", "rejected": "yes?"})])
    with pytest.raises(DataError) as err:
        preference_rows(_section(source), 512, 0)
    message = str(err.value)
    assert message.startswith(f"record {source}:2: 'chosen' and 'rejected' are the same tokens")
    assert "data.bad_records=skip" in message and "\n" not in message
    # skipped and counted as any bad record; the pair whose answers differ past the cut too
    train, _, _ = preference_rows(_section(source, bad_records="skip"), 512, 3)
    counts = train.counts
    assert (counts.records, counts.skipped, counts.examples) == (6, 3, 3)
    assert counts.bad[0].startswith(f"{source}:2: ") and "same tokens" in counts.bad[0]
    assert "once cut to preference.max_completion=3" in counts.bad[2]
    assert "3 bad records skipped" in counts.summary()
    rows = train.train
    assert rows is not None
    for row, slot in zip(*np.nonzero(rows["pair_slot"]), strict=True):  # each pair's answers
        mine = rows["pair_slot"][row] == rows["pair_slot"][row, slot]
        chosen = rows["tokens"][row][mine & (rows["answer"][row] == CHOSEN)]
        rejected = rows["tokens"][row][mine & (rows["answer"][row] == REJECTED)]
        assert not np.array_equal(chosen, rejected)
    # named by the record's own field names
    renamed = _pairs_file(tmp_path / "renamed.jsonl", [
        json.dumps({"prompt": "q", "good": "a", "bad": "a"})])
    with pytest.raises(DataError) as err:
        preference_rows(_section(renamed, fields={"chosen": "good", "rejected": "bad"}), 512, 0)
    assert "'good' and 'bad' are the same tokens" in str(err.value)


def test_a_file_with_no_usable_pair_left_is_one_line_naming_it(tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [_same(i) for i in range(4)])
    with pytest.raises(DataError) as err:
        preference_rows(_section(source, bad_records="skip"), 512, 0)
    message = str(err.value)
    assert message.startswith(f"no preference pairs to train on in {source} (")
    assert "4 bad records skipped" in message and "same tokens" in message
    assert message.endswith("fix or replace the bad records (data.bad_records=skip left them "
                            "out)")
    assert "\n" not in message


def test_each_pair_carries_its_records_margin_where_asked(tmp_path: Path) -> None:
    from trainrun.data.pair_rows import MARGIN

    margins = [0.5, -1.25, 2.0, 0.0, 3.5]
    source = _pairs_file(tmp_path / "pairs.jsonl", [
        json.dumps({"prompt": f"q{i} ", "chosen": "yes", "rejected": "no", "margin": m})
        for i, m in enumerate(margins)])
    plain, _, _ = preference_rows(_section(source), 512, 0)
    assert plain.train is not None and MARGIN not in plain.train  # not read unless asked
    kept, _, _ = preference_rows(_section(source), 512, 0, margins=True)
    rows = kept.train
    assert rows is not None and MARGIN in rows
    values = rows[MARGIN].view(np.float32)
    found = [float(values[row][rows["pair_slot"][row] == slot][0])
             for row in range(len(rows["tokens"]))
             for slot in range(1, int(rows["pair_slot"][row].max()) + 1)]
    assert sorted(found) == sorted(margins)
    again, _, _ = preference_rows(_section(source), 512, 0, margins=True)  # read back
    assert again.train is not None
    np.testing.assert_array_equal(again.train[MARGIN], rows[MARGIN])


def test_a_record_without_a_margin_is_a_bad_record_where_margins_are_read(
        tmp_path: Path) -> None:
    source = _pairs_file(tmp_path / "pairs.jsonl", [
        json.dumps({"prompt": "q0 ", "chosen": "yes", "rejected": "no", "margin": 1.0}),
        json.dumps({"prompt": "q1 ", "chosen": "yes", "rejected": "no"}),
        json.dumps({"prompt": "q2 ", "chosen": "yes", "rejected": "no", "margin": "big"})])
    with pytest.raises(DataError) as err:
        preference_rows(_section(source), 512, 0, margins=True)
    assert f"record {source}:2: no 'margin' field" in str(err.value)
    kept, _, _ = preference_rows(_section(source, bad_records="skip"), 512, 0, margins=True)
    assert (kept.counts.examples, kept.counts.skipped) == (1, 2)
    assert any("field 'margin' is" in line for line in kept.counts.bad)
