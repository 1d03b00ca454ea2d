"""How ranks start and stop (layer 11): the local launcher (torchrun's agent, ranks forked
from a forkserver), the elastic launcher and its rendezvous, stop signals."""
