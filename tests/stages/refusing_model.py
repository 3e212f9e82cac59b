"""A user's model (`--model tests.stages.refusing_model:factory`, for CartPole) whose layer after the cut refuses
to train: the network builds and acts, and stage1 fails in its first training minibatch, a problem no check
before the run can find."""

from torch import nn


class RefusesToTrain(nn.Module):
    """The identity, but RuntimeError on a tensor that needs a gradient (stage1's training features)."""

    def forward(self, x):
        if x.requires_grad:
            raise RuntimeError("this layer refuses to train")
        return x


def factory(observation_space, action_space):
    return [("fc1", nn.Linear(observation_space.shape[0], 8)), ("refuses", RefusesToTrain())]
