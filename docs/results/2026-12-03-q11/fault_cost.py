import sys, time, resource, numpy as np
if sys.argv[1] == "hold":
    from vqpipe.prefault import hold_freed_heap; hold_freed_heap()
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime, r.ru_stime, r.ru_minflt
for size in (16<<20, 600<<20):
  for rep in range(3):
    t=time.perf_counter(); c=cpu()
    arrs = [np.ones(size//4, np.float32) for _ in range((1<<30)//size)]
    d = [round(b-a,3) for a,b in zip(c,cpu())]
    print(sys.argv[1], size>>20, "MB x", len(arrs), round(time.perf_counter()-t,3), d, "us/fault", round(d[1]/max(d[2],1)*1e6,2))
    del arrs
