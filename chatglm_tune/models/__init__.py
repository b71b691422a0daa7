"""The model families: one folder each (`chatglm6b`, `glm`), the interface they implement (`version`), what every
family's modeling uses (`prefix`: the P-tuning v2 prefix encoder and its caches; `loss`: the training loss), and the
one table of versions (`registry`)."""
