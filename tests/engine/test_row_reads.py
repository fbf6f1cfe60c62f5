"""Large weights read from the file tier by their rows: an embedding gathers only its tokens' rows, a linear layer
larger than the staging computes from chunks of its rows; both give the resident model's numbers bit for bit, tied or
not, through staging far smaller than the weights, with the file tier's checks intact."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F
import transformers

import streamwise
from streamwise.runtime.checkpoint import CheckpointError, tiers
from streamwise.runtime.convert import applied_state
from streamwise.runtime.engine import file_tier, protocol, row_reads
from streamwise.runtime.engine.file_reads import FileTier

IDS = torch.tensor([[5, 9, 100, 4000, 5, 7, 4095, 0]])


@pytest.fixture
def small_chunks(monkeypatch):
    """Staging for chunks of a tiny model's head (4096 x 64 in float32: 1 MiB): 256 KiB."""
    monkeypatch.setattr(row_reads, "CHUNK", 256 << 10)


def saved(folder, tied: bool, intermediate_size: int = 128):
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def reads_of(model, monkeypatch) -> list[tuple[int, int]]:
    """Every (offset, bytes) the model's checked file reads from now on."""
    file = next(source.range.file for m in model.modules() for source in file_tier.sources(m).values())
    read_into, seen = type(file).read_into, []

    def recorded(self, ranges, **options):
        seen.extend((offset, buffer.numel()) for offset, buffer in ranges)
        return read_into(self, ranges, **options)

    monkeypatch.setattr(type(file), "read_into", recorded)
    return seen


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_embedding_and_head_left_in_the_file_compute_the_resident_numbers_through_small_staging(
        tmp_path, tied, small_chunks, monkeypatch):
    reference = saved(tmp_path, tied)
    with torch.no_grad():
        expected_logits, expected_tokens = reference(IDS).logits, reference.generate(IDS, max_new_tokens=6,
                                                                                         do_sample=False)
    loaded = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "600KiB"}, progress=False)
    model, placed = loaded.model, loaded.report.tiers
    embedding, head = model.model.embed_tokens, model.lm_head
    assert file_tier.on_file_tier(embedding, "weight") and file_tier.on_file_tier(head, "weight")
    assert (embedding.weight is head.weight) is tied  # a tie stays one tensor, in the file
    assert placed.staging_bytes <= 2 * (256 << 10) < head.weight.nbytes  # two chunks' staging: less than either
    seen = reads_of(model, monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected_logits)
        assert torch.equal(model.generate(IDS, max_new_tokens=6, do_sample=False), expected_tokens)
    assert applied_state(model).tree.file_tier.staging_bytes <= placed.staging_bytes
    source = file_tier.sources(embedding)["weight"].range
    rows = [(offset, size) for offset, size in seen if source.offset <= offset < source.offset + source.nbytes
            and size < source.nbytes]
    assert rows and all(size % 256 == 0 for _, size in rows)  # the embedding's: rows of 64 float32s
    assert seen.count((source.offset, source.nbytes)) == 0  # never its whole weight


def test_the_staging_a_forward_reads_through_is_what_the_load_counted_however_wide_the_rows(tmp_path, monkeypatch):
    """Chunks hold a multiple of `ALIGN` rows: where two such chunks of a projection's wide rows are larger than
    `CHUNK`, the load counts them (read whole where they take all of it), so the forward never grows the staging past
    the host budget (a float32 Qwen2's down projection took 11.5 MiB beside the 4 MiB counted, and was killed)."""
    monkeypatch.setattr(row_reads, "ALIGN", 32)
    monkeypatch.setattr(row_reads, "CHUNK", 8 << 10)  # a gate projection's aligned chunks (128 x 256 B rows): 16 KiB
    expected = saved(tmp_path, tied=False)
    loaded = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "100KiB"}, progress=False)
    model, placed = loaded.model, loaded.report.tiers
    gate = model.model.layers[-1].mlp.gate_proj
    assert file_tier.on_file_tier(gate, "weight") and placed.staging_bytes >= 2 * 32 * 256
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected(IDS).logits)
    assert 0 < applied_state(model).tree.file_tier.staging_bytes <= placed.staging_bytes


def test_an_embedding_gathers_only_the_distinct_rows_of_its_tokens(tmp_path, monkeypatch):
    saved(tmp_path, tied=False)
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "1MiB"}, progress=False).model
    embedding = model.model.embed_tokens
    assert row_reads.reading_by_rows(embedding, "embedding") == "gather"
    ids = torch.tensor([[7, 8, 9, 7, 4000, 8]])
    expected = F.embedding(ids, file_tier.sources(embedding)["weight"].read())
    seen = reads_of(model, monkeypatch)
    assert torch.equal(embedding(ids), expected)
    assert sorted(size // 256 for _, size in seen) == [1, 3]  # rows 7..9 in one read, 4000 in another
    on_meta = embedding(ids.to("meta"))  # a placement's trial run on a meta device: no ids, nothing read
    assert on_meta.is_meta and on_meta.shape == (*ids.shape, 64) and len(seen) == 2
    with pytest.raises(IndexError, match="index out of range in self"):  # as F.embedding says it
        embedding(torch.tensor([[3, 4096]]))


def test_what_cannot_be_read_by_rows_is_read_whole(tmp_path, small_chunks):
    """A renormalizing embedding writes its rows; a weight a LoRA function applies to is patched whole; a weight
    that fits the staging is read whole, ahead of its turn."""
    saved(tmp_path, tied=False)
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "600KiB"}, progress=False).model
    embedding, head = model.model.embed_tokens, model.lm_head
    assert row_reads.reading_by_rows(head, "linear") == "chunks"
    layer = next(m for m in model.model.layers.modules() if protocol.kind_of(m) == "linear"
                 and file_tier.on_file_tier(m, "weight"))
    assert row_reads.reading_by_rows(layer, "linear") is None  # 32 KiB: whole, in a 256 KiB arena
    head.weight_function = [lambda weight: weight * 2]
    assert row_reads.reading_by_rows(head, "linear") is None
    with torch.no_grad():
        doubled = head(torch.ones(1, 64))
    head.weight_function = []
    with torch.no_grad():
        assert torch.equal(doubled, 2 * head(torch.ones(1, 64)))
    embedding.max_norm = 1.0
    assert row_reads.row_reads("embedding", embedding) is None


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "in-the-forward"])
def test_a_linear_layers_next_chunks_are_read_while_one_computes(tmp_path, small_chunks, monkeypatch, read_ahead):
    """The head's chunks are read by the reader threads into the staging left free, the next ones while one computes
    (the disk and the compute overlap: a float32 Qwen2 half in its file decoded a token in 2.7x the raw read of its
    bytes with every chunk read in turn, 1.2x now); without read-ahead every chunk is read in the forward's own
    thread. The same numbers, through the same staging. The MLPs before the head are in the file too, read whole
    into the arenas (3/4 of one each): the last one read must not hold its arena through the head's chunks, nor the
    next forward's, read ahead, the other one (then every chunk was read in the forward, into fresh memory)."""
    reference = saved(tmp_path, tied=False, intermediate_size=768)
    with torch.no_grad():
        expected = reference(IDS).logits
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "1MiB"}, progress=False).model
    assert file_tier.in_file(model.model.layers[1].mlp.down_proj)
    assert row_reads.reading_by_rows(model.model.layers[1].mlp.down_proj, "linear") is None
    tier = applied_state(model).tree.file_tier
    tier.read_ahead = read_ahead
    source = file_tier.sources(model.lm_head)["weight"].range
    file, threads = source.file, []
    read_into = type(file).read_into

    def recorded(self, ranges, **options):
        threads.extend(threading.current_thread().name for offset, _ in ranges
                       if source.offset <= offset < source.offset + source.nbytes)
        return read_into(self, ranges, **options)

    monkeypatch.setattr(type(file), "read_into", recorded)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
        threads.clear()  # a steady forward: the order of the units learnt, the next ones read ahead
        assert torch.equal(model(IDS).logits, expected)
    ahead = [name for name in threads if name.startswith("streamwise-read-ahead")]
    assert len(threads) == len(row_reads.chunks(4096, row_reads._chunk_rows(file_tier.sources(model.lm_head)["weight"],
                                                                             tier)))
    assert len(ahead) == (len(threads) if read_ahead else 0), threads
    assert tier.staging_bytes <= 2 * (256 << 10)


def test_the_first_chunks_of_a_unit_are_read_while_the_unit_before_it_computes(tmp_path, monkeypatch):
    """Once a forward has learnt the order, each unit read by chunks of rows has its first chunk read by the reader
    threads before it starts: after a unit read whole, after another read by chunks (as that one's staging frees),
    and after modules in memory between them (a layer's attention, the final norm), so the disk never waits for a
    unit's turn (cold, a float32 Qwen2 half in its file decoded a token in 1.51x the raw read of its bytes with each
    unit's first chunk read at its start). Fails with the first chunks read by their own unit, and with the units
    after a chunked one started only once (then its successor's first chunk finds no staging: tried)."""
    monkeypatch.setattr(row_reads, "ALIGN", 32)
    monkeypatch.setattr(row_reads, "CHUNK", 8 << 10)
    reference = saved(tmp_path, tied=False)
    with torch.no_grad():
        expected = reference(IDS).logits
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "100KiB"}, progress=False).model
    chunked = {name: module for name, module in model.named_modules()
               if row_reads.reading_by_rows(module, protocol.kind_of(module)) == "chunks"}
    assert {"lm_head", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"} <= set(chunked)
    first_chunk = {file_tier.sources(module)["weight"].range.offset: name for name, module in chunked.items()}
    log = []
    read_rows_ahead = FileTier.read_rows_ahead

    def recorded(self, source, runs):
        pending = read_rows_ahead(self, source, runs)
        if pending is not None and runs[0][0] == 0 and source.range.offset in first_chunk:
            log.append(("read ahead", first_chunk[source.range.offset]))
        return pending

    monkeypatch.setattr(FileTier, "read_rows_ahead", recorded)
    for name, module in chunked.items():
        module.register_forward_pre_hook(lambda m, args, name=name: log.append(("starts", name)))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)  # the order learnt
        log.clear()
        assert torch.equal(model(IDS).logits, expected)
    for name in chunked:
        assert ("read ahead", name) in log and log.index(("read ahead", name)) < log.index(("starts", name)), log


def test_first_chunks_read_ahead_for_a_unit_the_forward_skips_give_their_staging_back(tmp_path, monkeypatch):
    """The head's first chunks are read ahead after the last layer; a call that stops before the head (the base
    model's forward) leaves them unused: the first unit read by chunks in the next call, finding nothing read ahead
    for it, gives their staging back, and the units' chunks are read ahead as before (fails with the head's reads kept
    through calls that skip it: tried)."""
    monkeypatch.setattr(row_reads, "ALIGN", 32)
    monkeypatch.setattr(row_reads, "CHUNK", 8 << 10)
    saved(tmp_path, tied=False, intermediate_size=768)
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "700KiB"}, progress=False).model
    first, head = model.model.layers[0].mlp.up_proj, model.lm_head  # the first unit read by chunks, and the last
    assert all(row_reads.reading_by_rows(m, protocol.kind_of(m)) == "chunks" for m in (first, head))
    source = file_tier.sources(first)["weight"].range
    threads = []
    read_into = type(source.file).read_into

    def recorded(self, ranges, **options):
        threads.extend(threading.current_thread().name for offset, _ in ranges
                       if source.offset <= offset < source.offset + source.nbytes)
        return read_into(self, ranges, **options)

    monkeypatch.setattr(type(source.file), "read_into", recorded)
    with torch.no_grad():
        model(IDS)
        model(IDS)  # the order learnt: the head's first chunks read ahead after the last layer
        model.model(IDS)  # and left unused
        threads.clear()
        model.model(IDS)
    tier = applied_state(model).tree.file_tier
    assert id(head) not in tier._rows_ahead  # what the head's reads held went back
    assert threads and all(name.startswith("streamwise-read-ahead") for name in threads), threads


def test_a_file_changed_under_a_row_read_is_an_error_naming_it(tmp_path, small_chunks):
    saved(tmp_path, tied=True)
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "600KiB"}, progress=False).model
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-8])  # truncated: a download cut short
    with pytest.raises(CheckpointError, match=str(weights)):
        model.model.embed_tokens(IDS)
    os.utime(weights)
    with pytest.raises(CheckpointError, match=str(weights)):
        model.lm_head(torch.ones(1, 64))


def test_a_unit_read_by_rows_needs_little_or_no_staging_so_more_of_the_rest_stays_in_memory(monkeypatch):
    """The budget counts a gathering embedding's staging as none and a chunked head's as two chunks: where staging
    for them whole takes most of the budget, a 1000-byte head stays in memory and far less is left in the file."""
    def unit(path, size, reads=None):
        source = file_tier.FileSource(type("Range", (), dict(file=None, offset=0, dtype=torch.uint8, shape=(size,),
                                                             nbytes=size))(), torch.uint8, (size,))
        return tiers.Unit(path, [(path, source)], reads)

    monkeypatch.setattr(row_reads, "CHUNK", 200)
    whole = [unit("embed", 1000), *(unit(f"layer{i}", 100) for i in range(10)), unit("head", 1000)]
    by_rows = [unit("embed", 1000, "gather"), *whole[1:-1], unit("head", 1000, "chunks")]
    as_whole = tiers.place("model", [], whole, tiers.HostBudget(1200, "a test's"))
    placed = tiers.place("model", [], by_rows, tiers.HostBudget(1200, "a test's"))
    assert (as_whole.staging_bytes, as_whole.file_bytes) == (1000, 2800)  # one buffer of a whole embedding or head
    assert placed.in_file == {"embed", *(f"layer{i}" for i in range(10))} and placed.host_bytes == 1000
    assert (placed.staging_bytes, placed.file_bytes) == (200, 2000)  # two staging buffers of the largest layer


#: Shapes of heads and projections (vocabularies, odd counts), dtypes and positions the chunking is held to.
SHAPES = [(4099, 64), (32000, 896), (151936 // 8 + 5, 1024), (1024, 2816)]


@pytest.mark.parametrize("rows, width", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_chunks_of_aligned_rows_compute_the_whole_weights_bits_on_the_cpu(rows, width, dtype):
    """A remainder block sums in another order than a full one: with chunks of `ALIGN` multiples, the last taking
    the rest, every output feature is computed in the same block as with the whole weight."""
    torch.manual_seed(0)
    weight, bias = torch.randn(rows, width).to(dtype), torch.randn(rows).to(dtype)
    step = 4 * row_reads.ALIGN
    for positions in (1, 3, 77, 300):
        x = torch.randn(1, positions, width).to(dtype)
        chunks = row_reads.chunks(rows, step)
        assert chunks[0][0] == 0 and chunks[-1][1] == rows and rows - chunks[-1][0] < 2 * step
        parts = [F.linear(x, weight[start:stop], bias[start:stop]) for start, stop in chunks]
        assert torch.equal(torch.cat(parts, dim=-1), F.linear(x, weight, bias)), positions


def test_a_tied_weight_a_later_placing_reads_back_stays_one_tensor(tmp_path, small_chunks):
    """A load leaves a tied embedding and head in the file; a placing that holds them in memory reads them once."""
    from streamwise.runtime.hosts.dispatch import dispatch

    saved(tmp_path, tied=True)
    model = streamwise.load_pretrained(tmp_path, max_memory={"cpu": "600KiB"}, progress=False).model
    with torch.no_grad():
        expected = model(IDS).logits
    dispatch(model, "decoder-llm", max_memory={"cpu": "1GiB"})
    assert model.lm_head.weight is model.model.embed_tokens.weight and file_tier.in_memory(model.lm_head.weight)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
