// libllm_datadist: the C++ API of LLM-DataDist on the llmdd engine.
//
// The library embeds CPython and drives the llmdd package through a small bridge module
// (cpp/python/llmdd_cpp_bridge.py, compiled into this library as text). Every call takes the
// GIL with PyGILState_Ensure and gives it back before returning; between calls no thread of
// the caller holds it. When the process already runs an interpreter (a C++ host embedding
// Python, or a Python process loading this library) that interpreter is used; otherwise one is
// started on the first Initialize, from the Python the library was configured with at CMake
// time (LLMDD_CPP_PYTHON) or the one named by the LLMDD_PYTHON environment variable.
// The library never prints; llm_datadist::llmdd::LastErrorMessage() gives the reason of a failure.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>

#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"
#include "llmdd_bridge_source.h"  // generated: kBridgeSource

#ifndef LLMDD_CPP_PYTHON
#define LLMDD_CPP_PYTHON ""
#endif
#ifndef LLMDD_CPP_SITE_DIRS
#define LLMDD_CPP_SITE_DIRS ""
#endif

namespace llm_datadist {
namespace {

thread_local std::string t_last_error;

std::mutex g_start_mutex;                 // starting an interpreter (no GIL exists yet then)
std::atomic<bool> g_exiting{false};       // set by the exit handler: Python is off limits
bool g_owns_interpreter = false;          // this library started the interpreter
PyObject *g_bridge = nullptr;             // the bridge module (under the GIL)

Status Fail(Status code, std::string message) {
  t_last_error = std::move(message);
  return code;
}

// True when Python can be entered from this thread.
bool PythonUsable() { return !g_exiting.load() && Py_IsInitialized() != 0; }

// SIGPIPE: llmdd writes to sockets whose peer may be gone (a control connection, a tcp data
// stream), and a write to a broken connection raises SIGPIPE, whose default disposition ends the
// process. A Python process ignores it; a C++ host keeps its own dispositions (the interpreter
// installs no signal handler). So every call blocks SIGPIPE in the calling thread for its
// duration: threads llmdd starts during a call inherit the blocked mask, a write then fails with
// EPIPE (a lost peer, handled as one), and a SIGPIPE raised for this thread during the call is
// discarded before the host's mask comes back. The host's dispositions are never changed.
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe, &old_) == 0 && sigismember(&old_, SIGPIPE) == 0;
    if (blocked_) {
      sigset_t pending;
      sigemptyset(&pending);
      was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    }
  }
  ~SigpipeBlock() {
    if (!blocked_) {
      return;  // the host blocks SIGPIPE itself: its own business
    }
    if (!was_pending_) {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      sigset_t pending;
      sigemptyset(&pending);
      if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
        const struct timespec zero = {0, 0};
        (void)sigtimedwait(&pipe, nullptr, &zero);  // raised by this call's writes: discarded
      }
    }
    (void)pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock &) = delete;
  SigpipeBlock &operator=(const SigpipeBlock &) = delete;

 private:
  sigset_t old_{};
  bool blocked_ = false;
  bool was_pending_ = false;
};

class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  // While the interpreter finalizes, a thread that waits for the GIL inside a call is ended by
  // Python (pthread_exit), and the unwinding runs this destructor without the GIL: nothing to give back.
  ~Gil() {
    if (!g_exiting.load(std::memory_order_relaxed) || PyGILState_Check() != 0) {
      PyGILState_Release(state_);
    }
  }
  Gil(const Gil &) = delete;
  Gil &operator=(const Gil &) = delete;

 private:
  SigpipeBlock sigpipe_;   // first: blocked before the GIL is taken, restored after it is given back
  PyGILState_STATE state_;
};

// The pending Python exception as text (clears it). Under the GIL.
std::string TakePythonError() {
  PyObject *type = nullptr;
  PyObject *value = nullptr;
  PyObject *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  std::string text = "unknown Python error";
  PyObject *shown = value != nullptr ? PyObject_Str(value) : (type != nullptr ? PyObject_Str(type) : nullptr);
  if (shown != nullptr) {
    const char *utf8 = PyUnicode_AsUTF8(shown);
    if (utf8 != nullptr) {
      text = utf8;
    }
    Py_DECREF(shown);
  }
  if (type != nullptr && PyType_Check(type)) {
    text = std::string(reinterpret_cast<PyTypeObject *>(type)->tp_name) + ": " + text;
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  return text;
}

// At exit (before the C++ statics of the libraries loaded with llmdd go): when this library
// started the interpreter, finalize it. Python's exit handlers finalize the engines their owners
// left and unlink their shared-memory segments; the transports' native state (UCX workers) is
// released before its libraries' destructors run. llmdd's threads are daemon threads: they stop
// when they next need the GIL, and so do C++ threads that are still inside a call.
void ExitHandler() {
  static std::atomic<bool> ran{false};
  if (ran.exchange(true)) {
    return;  // registered again after later loads; the first (= latest registered) call did it all
  }
  if (!g_owns_interpreter || Py_IsInitialized() == 0) {
    g_exiting.store(true);
    return;
  }
  (void)PyGILState_Ensure();
  g_exiting.store(true);
  // first the engines (as Finalize would), then the interpreter
  PyObject *globals = PyDict_New();
  if (globals != nullptr && PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins()) == 0) {
    // When the thread that started the interpreter (Python's "main thread") is gone or is not the
    // one exiting, Py_FinalizeEx would wait for it forever: its thread-state lock is released here.
    static const char kAtExit[] =
        "import gc, threading as _t, llmdd._api.datadist as _d\n"
        "_d._shutdown_handler()\n"
        "gc.collect()\n"
        "_m = _t.main_thread()\n"
        "if _m.ident != _t.get_ident():\n"
        "    _l = getattr(_m, '_tstate_lock', None)\n"
        "    if _l is not None and _l.locked():\n"
        "        _l.release()\n";
    PyObject *r = PyRun_String(kAtExit, Py_file_input, globals, globals);
    Py_XDECREF(r);
  }
  Py_XDECREF(globals);
  PyErr_Clear();
  (void)Py_FinalizeEx();
}

// Exit handlers run in the reverse order of registration, and the native libraries llmdd's
// transports load (NIXL, UCX) register their static destructors when they load. The handler is
// registered again after every call that may load one (Initialize, LinkLlmClusters), so that it
// runs before those destructors, while the engine can still close what they own.
std::atomic<int> g_exit_registrations{0};
void ArmExitHandler() {
  if (g_owns_interpreter && g_exit_registrations.fetch_add(1) < 4096) {
    (void)std::atexit(ExitHandler);
  }
}

// Add the configured site directories (".pth" files included) that sys.path lacks. Under the GIL.
bool AddSiteDirs(std::string &error) {
  const char *override_python = std::getenv("LLMDD_PYTHON");
  if (override_python != nullptr && override_python[0] != '\0') {
    return true;  // the named interpreter's own site directories are in use
  }
  const std::string dirs = LLMDD_CPP_SITE_DIRS;
  if (dirs.empty()) {
    return true;
  }
  PyObject *site = PyImport_ImportModule("site");
  PyObject *sys_path = PySys_GetObject("path");  // borrowed
  if (site == nullptr || sys_path == nullptr) {
    Py_XDECREF(site);
    error = "cannot import site: " + TakePythonError();
    return false;
  }
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(';', start);
    if (end == std::string::npos) {
      end = dirs.size();
    }
    const std::string dir = dirs.substr(start, end - start);
    if (!dir.empty()) {
      PyObject *item = PyUnicode_FromString(dir.c_str());
      const int present = item != nullptr ? PySequence_Contains(sys_path, item) : -1;
      if (present == 0) {
        PyObject *r = PyObject_CallMethod(site, "addsitedir", "O", item);
        Py_XDECREF(r);
      }
      Py_XDECREF(item);
      PyErr_Clear();
    }
    start = end + 1;
  }
  Py_DECREF(site);
  return true;
}

// Import the bridge (and with it llmdd). Under the GIL.
bool LoadBridge(std::string &error) {
  if (g_bridge != nullptr) {
    return true;
  }
  if (!AddSiteDirs(error)) {
    return false;
  }
  PyObject *code = Py_CompileString(kBridgeSource, "<libllm_datadist>/llmdd_cpp_bridge.py", Py_file_input);
  if (code == nullptr) {
    error = "cannot compile the llmdd bridge: " + TakePythonError();
    return false;
  }
  PyObject *module = PyImport_ExecCodeModuleEx("llmdd_cpp_bridge", code, "<libllm_datadist>/llmdd_cpp_bridge.py");
  Py_DECREF(code);
  if (module == nullptr) {
    std::string python = std::getenv("LLMDD_PYTHON") != nullptr ? std::getenv("LLMDD_PYTHON") : LLMDD_CPP_PYTHON;
    error = "cannot import llmdd (Python: " + python + "; set LLMDD_PYTHON to an interpreter whose "
            "environment has llmdd installed): " + TakePythonError();
    // a failed import leaves a half-made module in sys.modules: drop it so a retry starts clean
    PyObject *modules = PyImport_GetModuleDict();
    if (PyDict_GetItemString(modules, "llmdd_cpp_bridge") != nullptr) {
      PyDict_DelItemString(modules, "llmdd_cpp_bridge");
    }
    PyErr_Clear();
    return false;
  }
  if (g_bridge == nullptr) {
    g_bridge = module;
  } else {
    Py_DECREF(module);
  }
  return true;
}

// Make sure an interpreter runs and the bridge is loaded. Returns false with a reason.
bool EnsurePython(std::string &error) {
  if (g_exiting.load()) {
    error = "the process is exiting";
    return false;
  }
  if (Py_IsInitialized() == 0) {
    std::lock_guard<std::mutex> lk(g_start_mutex);
    if (Py_IsInitialized() == 0) {
      SigpipeBlock sigpipe;   // the interpreter's start and the bridge's import run outside Gil
      const char *override_python = std::getenv("LLMDD_PYTHON");
      const std::string python =
          (override_python != nullptr && override_python[0] != '\0') ? override_python : LLMDD_CPP_PYTHON;
      PyConfig config;
      PyConfig_InitPythonConfig(&config);
      config.install_signal_handlers = 0;  // the host keeps its signal dispositions
      config.parse_argv = 0;
      PyStatus st = PyStatus_Ok();
      if (!python.empty()) {
        // program_name: the interpreter's location decides sys.prefix (a venv's pyvenv.cfg included)
        st = PyConfig_SetBytesString(&config, &config.program_name, python.c_str());
      }
      if (!PyStatus_Exception(st)) {
        st = Py_InitializeFromConfig(&config);
      }
      PyConfig_Clear(&config);
      if (PyStatus_Exception(st)) {
        error = std::string("cannot start Python (") + python + "): " +
                (st.err_msg != nullptr ? st.err_msg : "unknown error");
        return false;
      }
      g_owns_interpreter = true;
      ArmExitHandler();
      std::string load_error;
      const bool loaded = LoadBridge(load_error);
      (void)PyEval_SaveThread();  // the GIL is free between calls
      if (!loaded) {
        error = load_error;
        return false;
      }
      return true;
    }
  }
  Gil gil;
  return LoadBridge(error);
}

// ---- argument conversions (under the GIL)
PyObject *StrMap(const std::map<AscendString, AscendString> &options) {
  PyObject *d = PyDict_New();
  if (d == nullptr) {
    return nullptr;
  }
  for (const auto &kv : options) {
    PyObject *k = PyUnicode_FromStringAndSize(kv.first.GetString(), static_cast<Py_ssize_t>(kv.first.GetLength()));
    PyObject *v =
        PyUnicode_FromStringAndSize(kv.second.GetString(), static_cast<Py_ssize_t>(kv.second.GetLength()));
    const int rc = (k != nullptr && v != nullptr) ? PyDict_SetItem(d, k, v) : -1;
    Py_XDECREF(k);
    Py_XDECREF(v);
    if (rc != 0) {
      Py_DECREF(d);
      return nullptr;
    }
  }
  return d;
}

template <typename T>
PyObject *UintList(const std::vector<T> &values) {
  PyObject *l = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (l == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject *item = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(values[i]));
    if (item == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, static_cast<Py_ssize_t>(i), item);
  }
  return l;
}

PyObject *IntList(const std::vector<int64_t> &values) {
  PyObject *l = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (l == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject *item = PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (item == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, static_cast<Py_ssize_t>(i), item);
  }
  return l;
}

PyObject *Desc(const CacheDesc &d) {
  PyObject *shape = IntList(d.shape);
  if (shape == nullptr) {
    return nullptr;
  }
  return Py_BuildValue("(IIiN)", static_cast<unsigned int>(d.placement), static_cast<unsigned int>(d.num_tensors),
                       static_cast<int>(d.data_type), shape);
}

// A tuple of the given new references (consumed; null when one is null or the tuple cannot be made).
PyObject *TupleOf(std::initializer_list<PyObject *> items) {
  PyObject *t = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
  Py_ssize_t i = 0;
  bool ok = t != nullptr;
  for (PyObject *item : items) {
    if (item == nullptr) {
      ok = false;
    } else if (t != nullptr) {
      PyTuple_SET_ITEM(t, i, item);
    } else {
      Py_DECREF(item);
    }
    ++i;
  }
  if (!ok) {
    Py_XDECREF(t);
    return nullptr;
  }
  return t;
}

PyObject *Index(const CacheIndex &i) {
  return TupleOf({PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(i.cluster_id)),
                  PyLong_FromLongLong(static_cast<long long>(i.cache_id)),
                  PyLong_FromUnsignedLong(static_cast<unsigned long>(i.batch_index))});
}

PyObject *Ext(const KvCacheExtParam &e) {
  return Py_BuildValue("((ii)(ii)I)", e.src_layer_range.first, e.src_layer_range.second, e.dst_layer_range.first,
                       e.dst_layer_range.second, static_cast<unsigned int>(e.tensor_num_per_layer));
}

PyObject *IpList(const std::vector<IpInfo> &ips) {
  PyObject *l = PyList_New(static_cast<Py_ssize_t>(ips.size()));
  if (l == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < ips.size(); ++i) {
    PyObject *item = Py_BuildValue("(s#H)", ips[i].ip.GetString(), static_cast<Py_ssize_t>(ips[i].ip.GetLength()),
                                   static_cast<unsigned short>(ips[i].port));
    if (item == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, static_cast<Py_ssize_t>(i), item);
  }
  return l;
}

PyObject *Clusters(const std::vector<ClusterInfo> &clusters) {
  PyObject *l = PyList_New(static_cast<Py_ssize_t>(clusters.size()));
  if (l == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < clusters.size(); ++i) {
    PyObject *local = IpList(clusters[i].local_ip_infos);
    PyObject *remote = local != nullptr ? IpList(clusters[i].remote_ip_infos) : nullptr;
    PyObject *item = remote != nullptr ? Py_BuildValue("(KNN)", static_cast<unsigned long long>(
                                                                    clusters[i].remote_cluster_id), local, remote)
                                       : nullptr;
    if (item == nullptr) {
      if (remote == nullptr) {
        Py_XDECREF(local);
      }
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, static_cast<Py_ssize_t>(i), item);
  }
  return l;
}

// The (status, message, value) answer of a bridge call; value is a new reference or null.
struct Answer {
  Status status = LLM_FAILED;
  PyObject *value = nullptr;
  ~Answer() { Py_XDECREF(value); }
};

// The bridge methods the C++ calls use, looked up once per bridge (bound methods).
enum Method {
  kInitialize, kFinalize, kSetRole, kLink, kUnlink, kAllocate, kDeallocate, kPullCache, kPullBlocks,
  kCopyCache, kCopyBlocks, kPushCache, kPushBlocks, kRegister, kUnregister, kMethodCount
};
const char *const kMethodNames[kMethodCount] = {
  "initialize", "finalize", "set_role", "link", "unlink", "allocate", "deallocate", "pull_cache", "pull_blocks",
  "copy_cache", "copy_blocks", "push_cache", "push_blocks", "register", "unregister"};

// Call fn(*args) (args: new references, consumed; a null one is a bad argument) with vectorcall:
// no argument tuple, and slot 0 is left free for the bound method's self. Under the GIL.
void Invoke(PyObject *fn, Method method, std::initializer_list<PyObject *> args, Answer &out) {
  constexpr size_t kMaxArgs = 7;
  PyObject *stack[kMaxArgs + 1] = {};
  size_t n = 0;
  bool bad = args.size() > kMaxArgs;
  for (PyObject *arg : args) {
    if (arg == nullptr || n >= kMaxArgs) {
      bad = true;
      Py_XDECREF(arg);
    } else {
      stack[1 + n++] = arg;
    }
  }
  const char *name = kMethodNames[method];
  if (bad) {
    for (size_t i = 1; i <= n; ++i) {
      Py_DECREF(stack[i]);
    }
    out.status = Fail(LLM_PARAM_INVALID, std::string(name) + ": bad argument: " + TakePythonError());
    return;
  }
  PyObject *result = PyObject_Vectorcall(fn, stack + 1, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  for (size_t i = 1; i <= n; ++i) {
    Py_DECREF(stack[i]);
  }
  if (result == nullptr || !PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 3) {
    const std::string why = result == nullptr ? TakePythonError() : "malformed bridge answer";
    Py_XDECREF(result);
    out.status = Fail(LLM_FAILED, std::string(name) + ": " + why);
    return;
  }
  const unsigned long code = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(result, 0));
  if (PyErr_Occurred() != nullptr) {
    const std::string why = TakePythonError();
    Py_DECREF(result);
    out.status = Fail(LLM_FAILED, std::string(name) + ": bad status: " + why);
    return;
  }
  out.status = static_cast<Status>(code);
  if (out.status == LLM_SUCCESS) {
    t_last_error.clear();
  } else {
    const char *msg = PyUnicode_AsUTF8(PyTuple_GET_ITEM(result, 1));
    t_last_error = msg != nullptr ? msg : "";
    PyErr_Clear();
  }
  out.value = PyTuple_GET_ITEM(result, 2);
  Py_INCREF(out.value);
  Py_DECREF(result);
}

bool StatusList(PyObject *value, std::vector<Status> &rets) {
  rets.clear();
  if (value == nullptr || !PyList_Check(value)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); ++i) {
    rets.push_back(static_cast<Status>(PyLong_AsUnsignedLong(PyList_GET_ITEM(value, i))));
  }
  PyErr_Clear();
  return true;
}
}  // namespace

namespace llmdd {
const char *LastErrorMessage() { return t_last_error.c_str(); }
}  // namespace llmdd

class LlmDataDist::LlmDataDistImpl {
 public:
  LlmDataDistImpl(uint64_t cluster_id, LlmRole role) : cluster_id_(cluster_id), role_(role) {}

  ~LlmDataDistImpl() {
    if (bridge_ == nullptr || !PythonUsable()) {
      return;  // at exit the exit handler already finalized the engine
    }
    Gil gil;
    Answer a;
    Invoke(fn_[kFinalize], kFinalize, {}, a);
    for (PyObject *&fn : fn_) {
      Py_CLEAR(fn);
    }
    Py_CLEAR(ext_);
    Py_CLEAR(bridge_);
  }

  Status Initialize(const std::map<AscendString, AscendString> &options) {
    std::string error;
    if (!EnsurePython(error)) {
      return Fail(LLM_FAILED, error);
    }
    Gil gil;
    if (bridge_ == nullptr) {
      PyObject *bridge = PyObject_CallMethod(g_bridge, "make", "Ki", static_cast<unsigned long long>(cluster_id_),
                                             static_cast<int>(role_));
      if (bridge == nullptr) {
        return Fail(LLM_FAILED, "cannot create the engine bridge: " + TakePythonError());
      }
      // the bound methods once, here: a call then neither looks a name up nor makes a method object
      PyObject *fns[kMethodCount] = {};
      for (int m = 0; m < kMethodCount; ++m) {
        fns[m] = PyObject_GetAttrString(bridge, kMethodNames[m]);
        if (fns[m] == nullptr) {
          const std::string why = TakePythonError();
          for (PyObject *&fn : fns) {
            Py_CLEAR(fn);
          }
          Py_DECREF(bridge);
          return Fail(LLM_FAILED, "cannot create the engine bridge: " + why);
        }
      }
      if (bridge_ == nullptr) {  // making the bridge ran Python code: another Initialize may have won
        std::copy(fns, fns + kMethodCount, fn_);
        bridge_ = bridge;  // last: a call that finds the bridge finds its methods (both under the GIL)
      } else {
        for (PyObject *&fn : fns) {
          Py_CLEAR(fn);
        }
        Py_DECREF(bridge);
      }
    }
    Answer a;
    Invoke(fn_[kInitialize], kInitialize, {StrMap(options)}, a);
    ArmExitHandler();
    return a.status;
  }

  void Finalize() {
    if (bridge_ == nullptr || !PythonUsable()) {
      return;
    }
    Gil gil;
    Answer a;
    Invoke(fn_[kFinalize], kFinalize, {}, a);
  }

  // Runs body(*this) under the GIL once the engine exists; LLM_FAILED before Initialize.
  template <typename Body>
  Status Call(Body body) {
    if (bridge_ == nullptr || !PythonUsable()) {
      return Fail(LLM_FAILED, "LlmDataDist is not initialized");
    }
    Gil gil;
    return body(*this);
  }

  // bridge.<method>(*args) (new references, consumed). Under the GIL (in Call's body).
  void Run(Method method, std::initializer_list<PyObject *> args, Answer &out) {
    Invoke(fn_[method], method, args, out);
  }

  // The ext argument as a new reference: the same tuple object while the ext is the same (the
  // bridge then reuses its check of it). Under the GIL.
  PyObject *ExtArg(const KvCacheExtParam &e) {
    if (ext_ == nullptr || e.src_layer_range != ext_value_.src_layer_range ||
        e.dst_layer_range != ext_value_.dst_layer_range ||
        e.tensor_num_per_layer != ext_value_.tensor_num_per_layer) {
      PyObject *made = Ext(e);
      if (made == nullptr) {
        return nullptr;
      }
      PyObject *old = ext_;
      ext_ = made;
      ext_value_ = e;
      Py_XDECREF(old);
    }
    Py_INCREF(ext_);
    return ext_;
  }

  uint64_t cluster_id_;
  LlmRole role_;
  PyObject *bridge_ = nullptr;
  PyObject *fn_[kMethodCount] = {};
  PyObject *ext_ = nullptr;  // the last ext argument made, for ext_value_
  KvCacheExtParam ext_value_;
};

LlmDataDist::LlmDataDist(uint64_t cluster_id, LlmRole role) : impl_(new LlmDataDistImpl(cluster_id, role)) {}

LlmDataDist::~LlmDataDist() = default;

Status LlmDataDist::Initialize(const std::map<AscendString, AscendString> &options) {
  return impl_->Initialize(options);
}

void LlmDataDist::Finalize() { impl_->Finalize(); }

Status LlmDataDist::SetRole(LlmRole role, const std::map<AscendString, AscendString> &options) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kSetRole, {PyLong_FromLong(static_cast<long>(role)), StrMap(options)}, a);
    if (a.status == LLM_SUCCESS) {
      impl_->role_ = role;
    }
    return a.status;
  });
}

Status LlmDataDist::LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                    int32_t timeout_in_millis) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kLink, {Clusters(clusters), PyLong_FromLong(timeout_in_millis)}, a);
    (void)StatusList(a.value, rets);
    ArmExitHandler();
    return a.status;
  });
}

Status LlmDataDist::UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                      int32_t timeout_in_millis, bool force_flag) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kUnlink, {Clusters(clusters), PyLong_FromLong(timeout_in_millis), PyBool_FromLong(force_flag ? 1 : 0)}, a);
    (void)StatusList(a.value, rets);
    return a.status;
  });
}

Status LlmDataDist::AllocateCache(const CacheDesc &cache_desc, Cache &cache) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kAllocate, {Desc(cache_desc)}, a);
    if (a.status != LLM_SUCCESS) {
      return a.status;
    }
    long long cache_id = -1;
    PyObject *addrs = nullptr;
    if (!PyArg_ParseTuple(a.value, "LO!", &cache_id, &PyList_Type, &addrs)) {
      return Fail(LLM_FAILED, "AllocateCache: malformed answer: " + TakePythonError());
    }
    cache.cache_id = cache_id;
    cache.tensor_addrs.clear();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(addrs); ++i) {
      cache.tensor_addrs.push_back(static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addrs, i))));
    }
    cache.cache_desc = cache_desc;
    return LLM_SUCCESS;
  });
}

Status LlmDataDist::DeallocateCache(int64_t cache_id) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kDeallocate, {PyLong_FromLongLong(static_cast<long long>(cache_id))}, a);
    return a.status;
  });
}

Status LlmDataDist::PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache, uint32_t batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kPullCache,
          {Index(src_cache_index), PyLong_FromLongLong(static_cast<long long>(dst_cache.cache_id)),
           PyLong_FromUnsignedLong(batch_index), PyLong_FromLongLong(static_cast<long long>(size)), Ext(ext_param)},
          a);
    return a.status;
  });
}

Status LlmDataDist::PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kPullBlocks,
          {Index(src_cache_index), PyLong_FromLongLong(static_cast<long long>(dst_cache.cache_id)),
           UintList(src_blocks), UintList(dst_blocks), d.ExtArg(ext_param)},
          a);
    return a.status;
  });
}

Status LlmDataDist::CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index,
                                uint32_t dst_batch_index, uint64_t offset, int64_t size) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kCopyCache,
          {PyLong_FromLongLong(static_cast<long long>(src_cache.cache_id)),
           PyLong_FromLongLong(static_cast<long long>(dst_cache.cache_id)), PyLong_FromUnsignedLong(src_batch_index),
           PyLong_FromUnsignedLong(dst_batch_index), PyLong_FromUnsignedLongLong(offset),
           PyLong_FromLongLong(static_cast<long long>(size))},
          a);
    return a.status;
  });
}

Status LlmDataDist::CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<std::vector<uint64_t>> &dst_blocks_list) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    PyObject *lists = PyList_New(static_cast<Py_ssize_t>(dst_blocks_list.size()));
    for (size_t i = 0; lists != nullptr && i < dst_blocks_list.size(); ++i) {
      PyObject *one = UintList(dst_blocks_list[i]);
      if (one == nullptr) {
        Py_CLEAR(lists);
        break;
      }
      PyList_SET_ITEM(lists, static_cast<Py_ssize_t>(i), one);
    }
    Answer a;
    d.Run(kCopyBlocks,
          {PyLong_FromLongLong(static_cast<long long>(src_cache.cache_id)),
           PyLong_FromLongLong(static_cast<long long>(dst_cache.cache_id)), UintList(src_blocks), lists},
          a);
    return a.status;
  });
}

Status LlmDataDist::PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index, uint32_t src_batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kPushCache,
          {PyLong_FromLongLong(static_cast<long long>(src_cache.cache_id)), Index(dst_cache_index),
           PyLong_FromUnsignedLong(src_batch_index), PyLong_FromLongLong(static_cast<long long>(size)),
           Ext(ext_param)},
          a);
    return a.status;
  });
}

Status LlmDataDist::PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kPushBlocks,
          {PyLong_FromLongLong(static_cast<long long>(src_cache.cache_id)), Index(dst_cache_index),
           UintList(src_blocks), UintList(dst_blocks), Ext(ext_param)},
          a);
    return a.status;
  });
}

Status LlmDataDist::RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                                    const RegisterCfg &cfg, int64_t &cache_id) {
  (void)cfg;  // reserved bytes only
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kRegister, {Desc(cache_desc), UintList(addrs)}, a);
    if (a.status == LLM_SUCCESS) {
      cache_id = static_cast<int64_t>(PyLong_AsLongLong(a.value));
      PyErr_Clear();
    }
    return a.status;
  });
}

Status LlmDataDist::UnregisterKvCache(int64_t cache_id) {
  return impl_->Call([&](LlmDataDistImpl &d) {
    Answer a;
    d.Run(kUnregister, {PyLong_FromLongLong(static_cast<long long>(cache_id))}, a);
    return a.status;
  });
}
}  // namespace llm_datadist
