"""The stage MILP: its stages (`stages`), model and run (`milp`), HiGHS and Pyomo backends (`backends`), plans (`extract`)."""
