"""ChainedHooks: several TrainerHooks (e.g. TensorBoard + resilience) behave as one."""

from megatron_het.train.trainer import ChainedHooks, TrainerHooks


class _Recorder(TrainerHooks):
    def __init__(self, name, events, *, repairs=False):
        self.name, self.events, self.repairs = name, events, repairs

    def on_step_start(self, trainer, iteration):
        self.events.append((self.name, "start", iteration))

    def on_action(self, trainer, iteration, index, action):
        self.events.append((self.name, "action", index))

    def on_step_end(self, trainer, log):
        self.events.append((self.name, "end", log))

    def on_failure(self, trainer, iteration, error):
        self.events.append((self.name, "failure", str(error)))
        return self.repairs


def test_every_hook_sees_every_event_in_order():
    events = []
    chain = ChainedHooks(_Recorder("a", events), _Recorder("b", events), _Recorder("c", events))
    chain.on_step_start(None, 3)
    chain.on_action(None, 3, 5, "F0")
    chain.on_step_end(None, "log")
    assert events == [("a", "start", 3), ("b", "start", 3), ("c", "start", 3),
                      ("a", "action", 5), ("b", "action", 5), ("c", "action", 5),
                      ("a", "end", "log"), ("b", "end", "log"), ("c", "end", "log")]


def test_failure_is_repaired_when_one_hook_repairs_it():
    events = []
    assert ChainedHooks(_Recorder("a", events), _Recorder("b", events, repairs=True)).on_failure(None, 1, RuntimeError("x"))
    assert [e[0] for e in events] == ["a", "b"]
    assert not ChainedHooks(_Recorder("a", [])).on_failure(None, 1, RuntimeError("x"))
