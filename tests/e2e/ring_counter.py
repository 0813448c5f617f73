"""A Trainer that counts the ring all-reduce's messages from outside the code under test.

Used by CLI tests as ``recipe.trainer_class=tests.e2e.ring_counter.RingCountingMnistTrainer``: it
wraps its process group's ``send`` (through which every point-to-point message leaves) and counts
the messages carrying the ring's tag, then writes ``ring_rank<r>.json`` into the run directory.
A ``dist.algorithm=ring`` that is silently ignored sends none.
"""

import json

from ddptrain.comm.ring import RING_TAG
from ddptrain.recipes.mnist import MnistTrainer


class RingCountingMnistTrainer(MnistTrainer):
    def setup_distributed(self):
        created = super().setup_distributed()
        self.ring_sent = {"messages": 0, "elements": 0}
        send = self.process_group.send

        def counting_send(tensor, dst, tag=0):
            if tag == RING_TAG:
                self.ring_sent["messages"] += 1
                self.ring_sent["elements"] += tensor.numel()
            return send(tensor, dst, tag)

        self.process_group.send = counting_send
        return created

    def fit(self):
        final = super().fit()
        trainable = sum(p.numel() for p in self.model.module.parameters() if p.requires_grad)
        report = {**self.ring_sent, "steps": final["step"], "trainable": trainable, "world_size": self.world_size}
        (self.output_dir / f"ring_rank{self.rank}.json").write_text(json.dumps(report))
        return final
