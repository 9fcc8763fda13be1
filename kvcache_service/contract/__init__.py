"""The manager's contract, in one home for every side of it: plain types, errors and the page
hash (no protobuf: the core uses them too), protobuf conversion both ways (convert.py) and the
client (client.py) that the model service, and a gateway, talk to the manager with."""
