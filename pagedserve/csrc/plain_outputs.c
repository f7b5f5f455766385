/* The output processor's plain path: a step's outputs that only bring tokens with a text of their own to a request of one
 * sample that asked for no logprobs and no stop strings (most outputs of most steps) become RequestOutputs here, and
 * every other output goes to the Python path (engine/output_processor.py), which stays the reference.
 *
 * The Python classes that hold the state (IncrementalDetokenizer, SampleState, RequestState) derive from the types
 * below, which declare the fields this path reads and writes as C fields with the same attribute names: Python reads
 * and writes them as before, and this path reaches them without an attribute lookup. An EngineCoreOutput's fields are
 * read at the offsets its msgspec Struct type gives them (configure()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>

/* SampleFields.plain_mode: how a sample whose request may take the plain path reports; NOT_PLAIN never does. */
enum { NOT_PLAIN = -1, PLAIN_CUMULATIVE = 0, PLAIN_DELTA = 1, PLAIN_FINAL_ONLY = 2 };

/* ---- the state types ---- */

typedef struct {
    PyObject_HEAD
    PyObject *token_ids;   /* list[int] */
    PyObject *output_text; /* str */
    PyObject *stream;      /* _stream: a DecodeStream, or None while the text ends at a whole character */
    PyObject *token_texts; /* _token_texts: list[str | None] or None */
    Py_ssize_t sent_chars; /* _sent_chars */
} TextFields;

typedef struct {
    PyObject_HEAD
    PyObject *detokenizer;
    Py_ssize_t index;
    Py_ssize_t sent_tokens;
    int plain_mode;
} SampleFields;

typedef struct {
    PyObject_HEAD
    PyObject *request_id;
    PyObject *prompt;
    PyObject *prompt_token_ids;
    PyObject *kv_transfer_params;
    Py_ssize_t num_cached_tokens;
} RequestFields;

/* Every object field starts as None, so that Python never meets an unset one. */
static void set_none(PyObject **fields[], int count) {
    for (int i = 0; i < count; i++) {
        Py_INCREF(Py_None);
        *fields[i] = Py_None;
    }
}

#define OBJECT_FIELDS_TEXT(self) {&(self)->token_ids, &(self)->output_text, &(self)->stream, &(self)->token_texts}
#define OBJECT_FIELDS_SAMPLE(self) {&(self)->detokenizer}
#define OBJECT_FIELDS_REQUEST(self) {&(self)->request_id, &(self)->prompt, &(self)->prompt_token_ids, &(self)->kv_transfer_params}

/* new, traverse, clear and dealloc of one state type, over its object fields. */
#define STATE_TYPE_FUNCTIONS(Name, FIELDS, COUNT)                                                                   \
    static PyObject *Name##_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {                            \
        Name *self = (Name *)type->tp_alloc(type, 0);                                                              \
        if (self != NULL) {                                                                                          \
            PyObject **fields[] = FIELDS(self);                                                                      \
            set_none(fields, COUNT);                                                                                 \
        }                                                                                                            \
        return (PyObject *)self;                                                                                     \
    }                                                                                                                \
    static int Name##_traverse(Name *self, visitproc visit, void *arg) {                                            \
        PyObject **fields[] = FIELDS(self);                                                                          \
        for (int i = 0; i < COUNT; i++) Py_VISIT(*fields[i]);                                                       \
        return 0;                                                                                                    \
    }                                                                                                                \
    static int Name##_clear(Name *self) {                                                                            \
        PyObject **fields[] = FIELDS(self);                                                                          \
        for (int i = 0; i < COUNT; i++) Py_CLEAR(*fields[i]);                                                       \
        return 0;                                                                                                    \
    }                                                                                                                \
    static void Name##_dealloc(Name *self) {                                                                         \
        PyObject_GC_UnTrack(self);                                                                                   \
        Name##_clear(self);                                                                                          \
        Py_TYPE(self)->tp_free((PyObject *)self);                                                                    \
    }

STATE_TYPE_FUNCTIONS(TextFields, OBJECT_FIELDS_TEXT, 4)
STATE_TYPE_FUNCTIONS(SampleFields, OBJECT_FIELDS_SAMPLE, 1)
STATE_TYPE_FUNCTIONS(RequestFields, OBJECT_FIELDS_REQUEST, 4)

static PyMemberDef TextFields_members[] = {
    {"token_ids", T_OBJECT_EX, offsetof(TextFields, token_ids), 0, NULL},
    {"output_text", T_OBJECT_EX, offsetof(TextFields, output_text), 0, NULL},
    {"_stream", T_OBJECT_EX, offsetof(TextFields, stream), 0, NULL},
    {"_token_texts", T_OBJECT_EX, offsetof(TextFields, token_texts), 0, NULL},
    {"_sent_chars", T_PYSSIZET, offsetof(TextFields, sent_chars), 0, NULL},
    {NULL},
};

static PyMemberDef SampleFields_members[] = {
    {"detokenizer", T_OBJECT_EX, offsetof(SampleFields, detokenizer), 0, NULL},
    {"index", T_PYSSIZET, offsetof(SampleFields, index), 0, NULL},
    {"sent_tokens", T_PYSSIZET, offsetof(SampleFields, sent_tokens), 0, NULL},
    {"plain_mode", T_INT, offsetof(SampleFields, plain_mode), 0, NULL},
    {NULL},
};

static PyMemberDef RequestFields_members[] = {
    {"request_id", T_OBJECT_EX, offsetof(RequestFields, request_id), 0, NULL},
    {"prompt", T_OBJECT_EX, offsetof(RequestFields, prompt), 0, NULL},
    {"prompt_token_ids", T_OBJECT_EX, offsetof(RequestFields, prompt_token_ids), 0, NULL},
    {"kv_transfer_params", T_OBJECT_EX, offsetof(RequestFields, kv_transfer_params), 0, NULL},
    {"num_cached_tokens", T_PYSSIZET, offsetof(RequestFields, num_cached_tokens), 0, NULL},
    {NULL},
};

#define STATE_TYPE(Name, doc)                                                                                       \
    static PyTypeObject Name##_Type = {                                                                              \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pagedserve_plain_outputs." #Name,                                 \
        .tp_basicsize = sizeof(Name),                                                                                \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,                                   \
        .tp_doc = doc,                                                                                               \
        .tp_new = Name##_new,                                                                                        \
        .tp_traverse = (traverseproc)Name##_traverse,                                                                \
        .tp_clear = (inquiry)Name##_clear,                                                                           \
        .tp_dealloc = (destructor)Name##_dealloc,                                                                    \
        .tp_members = Name##_members,                                                                                \
    };

STATE_TYPE(TextFields, "The fields of an IncrementalDetokenizer that the plain path reads and writes.")
STATE_TYPE(SampleFields, "The fields of a SampleState that the plain path reads and writes.")
STATE_TYPE(RequestFields, "The fields of a RequestState that the plain path reads and writes.")

/* ---- the types the path reads and makes (configure) ---- */

static PyTypeObject *engine_output_type, *request_output_type, *completion_output_type;

/* Where an EngineCoreOutput holds each field this path reads. */
static struct {
    Py_ssize_t request_id, new_token_ids, new_logprobs, new_prompt_logprobs, finish_reason, num_cached_tokens,
        kv_transfer_params, pooled;
} output_at;

static int field_offset(PyTypeObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *descriptor = PyDict_GetItemString(type->tp_dict, name); /* borrowed */
    if (descriptor == NULL || !Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a field of the Struct", type->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
    if (member->type != T_OBJECT_EX && member->type != T_OBJECT) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object field", type->tp_name, name);
        return -1;
    }
    *offset = member->offset;
    return 0;
}

static PyObject *configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "configure(EngineCoreOutput, RequestOutput, CompletionOutput)");
        return NULL;
    }
    PyTypeObject *engine_output = (PyTypeObject *)args[0];
    if (field_offset(engine_output, "request_id", &output_at.request_id) < 0 ||
        field_offset(engine_output, "new_token_ids", &output_at.new_token_ids) < 0 ||
        field_offset(engine_output, "new_logprobs", &output_at.new_logprobs) < 0 ||
        field_offset(engine_output, "new_prompt_logprobs", &output_at.new_prompt_logprobs) < 0 ||
        field_offset(engine_output, "finish_reason", &output_at.finish_reason) < 0 ||
        field_offset(engine_output, "num_cached_tokens", &output_at.num_cached_tokens) < 0 ||
        field_offset(engine_output, "kv_transfer_params", &output_at.kv_transfer_params) < 0 ||
        field_offset(engine_output, "pooled", &output_at.pooled) < 0)
        return NULL;
    Py_INCREF(args[0]);
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(engine_output_type, engine_output);
    Py_XSETREF(request_output_type, (PyTypeObject *)args[1]);
    Py_XSETREF(completion_output_type, (PyTypeObject *)args[2]);
    Py_RETURN_NONE;
}

/* ---- the path ---- */

static inline PyObject *field(PyObject *object, Py_ssize_t offset) { /* borrowed; NULL if unset */
    return *(PyObject **)((char *)object + offset);
}

/* The texts of the output's tokens from the table, checked before anything changes; 0 if some token has none (it
 * needs the stream) or a value is not what the plain path knows. */
static int tokens_have_texts(PyObject *token_ids, PyObject *table) {
    Py_ssize_t table_size = PyList_GET_SIZE(table);
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(token_ids); i < n; i++) {
        PyObject *token = PyList_GET_ITEM(token_ids, i);
        if (!PyLong_CheckExact(token))
            return 0;
        Py_ssize_t id = PyLong_AsSsize_t(token);
        if (id < 0 || id >= table_size) {
            PyErr_Clear();
            return 0;
        }
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(table, id)))
            return 0;
    }
    return 1;
}

/* The output's tokens and their texts added to the detokenizer's; -1 with an exception set. */
static int add_tokens(TextFields *text, PyObject *token_ids) {
    PyObject *table = text->token_texts;
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(token_ids); i < n; i++) {
        PyObject *token = PyList_GET_ITEM(token_ids, i);
        if (PyList_Append(text->token_ids, token) < 0)
            return -1;
        PyObject *chunk = PyList_GET_ITEM(table, PyLong_AsSsize_t(token));
        if (PyUnicode_GET_LENGTH(chunk) == 0)
            continue;
        /* The field lets go of the text first, so that the append extends it in place when nothing else holds it. */
        PyObject *output_text = text->output_text;
        text->output_text = NULL;
        PyUnicode_Append(&output_text, chunk);
        if (output_text == NULL) {
            Py_INCREF(Py_None);
            text->output_text = Py_None;
            return -1;
        }
        text->output_text = output_text;
    }
    return 0;
}

/* The sample's CompletionOutput for this step: what is new (delta) or everything so far. */
static PyObject *make_completion(SampleFields *sample, TextFields *text, int delta) {
    PyObject *output_text = text->output_text, *token_ids = text->token_ids, *report_text, *report_ids;
    Py_ssize_t text_length = PyUnicode_GET_LENGTH(output_text), num_tokens = PyList_GET_SIZE(token_ids);
    if (delta) {
        Py_ssize_t sent = text->sent_chars < text_length ? text->sent_chars : text_length;
        report_text = PyUnicode_Substring(output_text, sent, text_length);
        report_ids = PyList_GetSlice(token_ids, sample->sent_tokens, num_tokens);
        text->sent_chars = text_length;
        sample->sent_tokens = num_tokens;
    } else {
        Py_INCREF(output_text);
        report_text = output_text;
        report_ids = PyList_GetSlice(token_ids, 0, num_tokens);
    }
    PyObject *index = PyLong_FromSsize_t(sample->index);
    PyObject *completion = NULL;
    if (report_text != NULL && report_ids != NULL && index != NULL) {
        PyObject *fields[7] = {index, report_text, report_ids, Py_None, Py_None, Py_None, Py_None};
        completion = PyObject_Vectorcall((PyObject *)completion_output_type, fields, 7, NULL);
    }
    Py_XDECREF(index);
    Py_XDECREF(report_text);
    Py_XDECREF(report_ids);
    return completion;
}

static PyObject *make_request_output(RequestFields *state, PyObject *completion) {
    PyObject *completions = PyList_New(1);
    PyObject *num_cached = PyLong_FromSsize_t(state->num_cached_tokens);
    PyObject *output = NULL;
    if (completions != NULL && num_cached != NULL) {
        Py_INCREF(completion);
        PyList_SET_ITEM(completions, 0, completion);
        PyObject *fields[8] = {state->request_id, state->prompt, state->prompt_token_ids, completions, Py_False,
                               Py_None, num_cached, state->kv_transfer_params};
        output = PyObject_Vectorcall((PyObject *)request_output_type, fields, 8, NULL);
    }
    Py_XDECREF(completions);
    Py_XDECREF(num_cached);
    return output;
}

/* 1: the output went the plain path, with its request output (if its kind reports one now) appended; 0: it is not a
 * plain output; -1: an exception is set. */
static int process_plain(PyObject *output, PyObject *state_object, PyObject *sample_object, PyObject *request_outputs) {
    if (!PyObject_TypeCheck(sample_object, &SampleFields_Type) || !PyObject_TypeCheck(state_object, &RequestFields_Type))
        return 0;
    SampleFields *sample = (SampleFields *)sample_object;
    RequestFields *state = (RequestFields *)state_object;
    if (sample->plain_mode == NOT_PLAIN || !PyObject_TypeCheck(sample->detokenizer, &TextFields_Type))
        return 0;
    TextFields *text = (TextFields *)sample->detokenizer;
    PyObject *token_ids = field(output, output_at.new_token_ids), *num_cached = field(output, output_at.num_cached_tokens);
    if (field(output, output_at.finish_reason) != Py_None || field(output, output_at.new_logprobs) != Py_None ||
        field(output, output_at.new_prompt_logprobs) != Py_None || field(output, output_at.kv_transfer_params) != Py_None ||
        field(output, output_at.pooled) != Py_None || token_ids == NULL || !PyList_CheckExact(token_ids) ||
        num_cached == NULL || !PyLong_CheckExact(num_cached))
        return 0;
    if (text->stream != Py_None || !PyList_CheckExact(text->token_texts) || !PyList_CheckExact(text->token_ids) ||
        !PyUnicode_CheckExact(text->output_text) || !tokens_have_texts(token_ids, text->token_texts))
        return 0;
    Py_ssize_t cached = PyLong_AsSsize_t(num_cached);
    if (cached == -1 && PyErr_Occurred())
        return -1;
    state->num_cached_tokens = cached;
    if (add_tokens(text, token_ids) < 0)
        return -1;
    if (sample->plain_mode == PLAIN_FINAL_ONLY)
        return 1; /* unfinished: nothing to report */
    PyObject *completion = make_completion(sample, text, sample->plain_mode == PLAIN_DELTA);
    if (completion == NULL)
        return -1;
    PyObject *request_output = make_request_output(state, completion);
    Py_DECREF(completion);
    if (request_output == NULL)
        return -1;
    int appended = PyList_Append(request_outputs, request_output);
    Py_DECREF(request_output);
    return appended < 0 ? -1 : 1;
}

/* One output of process(): 1 when processed or its request is unknown, -1 with an exception set. */
static int process_one(PyObject *output, int exact, PyObject *request_id, PyObject *const *args) {
    PyObject *entry = PyDict_GetItemWithError(args[1], request_id); /* borrowed */
    if (entry == NULL)
        return PyErr_Occurred() ? -1 : 1; /* aborted in the front end while the step ran */
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "engine_samples' values are (state, sample) pairs");
        return -1;
    }
    Py_INCREF(entry);
    PyObject *state = PyTuple_GET_ITEM(entry, 0), *sample = PyTuple_GET_ITEM(entry, 1);
    int done = exact ? process_plain(output, state, sample, args[2]) : 0;
    if (done == 0) {
        PyObject *call[6] = {state, sample, output, args[2], args[4], args[5]};
        PyObject *result = PyObject_Vectorcall(args[3], call, 6, NULL);
        done = result == NULL ? -1 : 1;
        Py_XDECREF(result);
    }
    Py_DECREF(entry);
    return done;
}

/* process(outputs, engine_samples, request_outputs, other, reqs_to_abort, gathered): each output whose request is
 * known (engine_samples: engine request id -> (state, sample)) goes the plain path or to
 * other(state, sample, output, request_outputs, reqs_to_abort, gathered), in the outputs' order. */
static PyObject *process(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "process(outputs: list, engine_samples: dict, request_outputs: list, other, "
                                         "reqs_to_abort, gathered)");
        return NULL;
    }
    if (engine_output_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() first");
        return NULL;
    }
    PyObject *outputs = args[0];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *output = PyList_GET_ITEM(outputs, i);
        Py_INCREF(output); /* the list may change under a call to other() */
        int exact = Py_IS_TYPE(output, engine_output_type);
        PyObject *request_id = exact ? field(output, output_at.request_id) : NULL;
        if (request_id != NULL)
            Py_INCREF(request_id);
        else /* not an EngineCoreOutput, or a field deleted: Python's lookup, and its error */
            request_id = PyObject_GetAttrString(output, "request_id");
        int done = request_id == NULL ? -1 : process_one(output, exact, request_id, args);
        Py_XDECREF(request_id);
        Py_DECREF(output);
        if (done < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(EngineCoreOutput, RequestOutput, CompletionOutput): the types the plain path reads and makes."},
    {"process", (PyCFunction)(void (*)(void))process, METH_FASTCALL,
     "process(outputs, engine_samples, request_outputs, other, reqs_to_abort, gathered): one step's outputs."},
    {NULL},
};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "pagedserve_plain_outputs", NULL, -1, methods};

PyMODINIT_FUNC PyInit_pagedserve_plain_outputs(void) {
    PyTypeObject *types[] = {&TextFields_Type, &SampleFields_Type, &RequestFields_Type};
    for (int i = 0; i < 3; i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL)
        return NULL;
    const char *names[] = {"TextFields", "SampleFields", "RequestFields"};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(module);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(module, "NOT_PLAIN", NOT_PLAIN) < 0 ||
        PyModule_AddIntConstant(module, "PLAIN_CUMULATIVE", PLAIN_CUMULATIVE) < 0 ||
        PyModule_AddIntConstant(module, "PLAIN_DELTA", PLAIN_DELTA) < 0 ||
        PyModule_AddIntConstant(module, "PLAIN_FINAL_ONLY", PLAIN_FINAL_ONLY) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
