"""The bundled front end: DJL Serving's batching loops in-process, driving handle() as the container does.

requests.py: the accepted requests (ClientRequest, the waiting queue, deadlines, cancel); loops.py: the
rolling and dynamic loops that build each handle() call and fan its entries back. HTTP is server/'s; the
batch jobs (batch/jobs.py) use FrontEnd.has_room and FrontEnd.submit. Imports nothing from server/ or batch/.
"""
