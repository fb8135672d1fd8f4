"""rayjobs: a Ray-orchestrated, scalable PyTorch trainer."""

__version__ = "0.1.0"
