"""Drop-in surfaces of other transfer libraries, implemented on kvt.

``kvt.compat.mooncake.TransferEngine``: the transfer engine object tokenspeed's and SGLang's
Mooncake backends call (register memory, push writes into a peer's registered memory).
"""
