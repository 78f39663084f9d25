"""The front end's helpers under the Communicator: argument and buffer checks, point-to-point
and v-collectives, call descriptors and compiled plans, a communicator's topology view."""
