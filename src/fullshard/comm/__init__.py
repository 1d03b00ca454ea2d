"""Process groups, devices and collectives (layers 2 and 4): everything that talks to c10d."""
