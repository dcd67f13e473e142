"""The weight sources satisfy the installed vLLM's WeightSource protocol, as
its IPC trainer engine consumes them (0.32: `iter(source)`; 0.33:
`metadata` as an attribute, `iter_full()`, `implements_iter_full()`,
`owned_names(rank)`), over FSDP2 on 2 gloo ranks."""

import inspect

import torch

from conftest import run_ranks


def _consume_as_vllm_does(trainer, ckpt, out_dir):
    from vllm.distributed.weight_transfer.base import WeightSource

    import checks

    trainer.build_model(str(ckpt))
    trainer.init_weights(str(ckpt), random_init=False)
    report = {}
    for loader in ("vllm", "direct"):
        source = trainer.weight_source(loader)  # MeasuredTrainer's: the timed wrapper around the source
        assert isinstance(source, checks.TimedSource)
        for s in (source, source._source):
            assert isinstance(s, WeightSource) and not inspect.isabstract(type(s)), type(s)
        names = [m.name for m in source.metadata]
        assert source.metadata is source.metadata  # computed once: engines read it repeatedly
        passes = {"iter": [(n, t.detach().clone()) for n, t in iter(source)]}
        if "iter_full" in vars(WeightSource):  # vLLM >= 0.33 calls this instead
            assert source.implements_iter_full()
            assert source.owned_names(trainer.rank) == names  # IPC: every rank owns every tensor
            passes["iter_full"] = [(n, t.detach().clone()) for n, t in source.iter_full()]
        for got in passes.values():
            assert [n for n, _ in got] == names  # metadata order, every name once
            for (name, t), meta in zip(got, source.metadata, strict=True):
                assert (t.dtype, tuple(t.shape)) == (meta.dtype, tuple(meta.shape)), name
        first, *others = passes.values()
        for other in others:
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, other, strict=True))
        report[loader] = len(names)
    torch.save(report, out_dir / f"rank{trainer.rank}.pt")


def test_the_weight_sources_are_vllm_weight_sources(tiny_checkpoint, tmp_path):
    run_ranks(_consume_as_vllm_does, 2, tiny_checkpoint, tmp_path)
    reports = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert reports[0] == reports[1] and reports[0]["vllm"] > reports[0]["direct"] > 0
