"""`kvserve bench`: performance figures that anyone can reproduce, always as ratios against a peer
measured in the same run (absolute times on shared machines drift; ratios taken side by side do not)."""
